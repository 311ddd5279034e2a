"""Model weights travel in their own dtype: bfloat16 as its bit patterns, exactly."""

import pytest
import torch
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto

from wire.arrays import array_tensor, weight_array, weights_record
from wire.delivery import record_digests, weight_digest


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_weight_survives_flowers_serialisation_bit_for_bit_in_its_dtype(dtype):
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    sent = RecordDict({"arrays": weights_record({"w": weight})})
    received = recorddict_from_proto(recorddict_to_proto(sent))["arrays"]["w"]
    back = array_tensor(received)
    assert back.dtype == dtype and torch.equal(back, weight)
    assert len(received.data) < 2 * weight.numel() * weight.element_size()  # not widened
    # its digest is that of its float32 value: the same whatever dtype holds it
    assert record_digests(ArrayRecord({"w": received}))["w"] == weight_digest(weight.float())


def test_a_bfloat16_array_whose_payload_is_not_16_bit_patterns_is_refused():
    forged = Array(torch.zeros(3).numpy())  # float32 payload
    forged = Array(dtype="bfloat16", shape=forged.shape, stype=forged.stype, data=forged.data)
    with pytest.raises(ValueError, match="bfloat16 array must hold uint16"):
        array_tensor(forged)


def test_weight_array_is_a_plain_numpy_array_for_numpy_dtypes():
    array = weight_array(torch.ones(2, dtype=torch.float16))
    assert array.dtype == "float16" and array.numpy().tolist() == [1.0, 1.0]
