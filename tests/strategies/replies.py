"""Helpers of the strategy tests: what the SuperLink hands the ServerApp."""

from flwr.app import MessageType, Metadata


def reply_metadata(node: int, group_id: str = "1") -> Metadata:
    """Metadata of a TRAIN reply sent by ``node`` in round (group) ``group_id``."""
    return Metadata(
        run_id=1,
        message_id=f"reply-{node}",
        src_node_id=node,
        dst_node_id=0,
        reply_to_message_id=f"train-{node}",
        group_id=group_id,
        created_at=0.0,
        ttl=3600.0,
        message_type=MessageType.TRAIN,
    )
