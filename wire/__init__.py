"""The Flower wire protocol the ClientApp (``clients/``) and the strategies (``strategies/``)
share: how the model, the task vectors and Fisher diagonals travel (:mod:`.messages`) and the
keys and hashes of delivering only what differs from a node's base checkpoint
(:mod:`.delivery`). Neither side imports the other; both import this.
"""
