"""The backend protocol's device names: a name of the wrong form, or one whose runtime is missing
here, is refused naming the device and what is allowed."""
import importlib.util
import sys

import pytest

from hw.backend import Backend, check_device
from twin.abi.batches import DispatchResult
from twin.abi.errors import AbiError


def test_device_names():
    for ok in ("cpu", "cuda:1", "npu:7"):
        assert check_device(ok, available=False) == ok
    for bad in ("tpu", "cpu:x", "", None, "npu:-1"):
        with pytest.raises(AbiError, match="device"):
            check_device(bad)
    assert check_device("cpu") == "cpu"
    if importlib.util.find_spec("torch_npu") is None:     # a named device whose runtime is missing
        with pytest.raises(AbiError, match="npu:7.*torch_npu is not installed"):
            check_device("npu:7")
    assert "torch_npu" not in sys.modules                  # only an "npu" device imports it
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(AbiError, match="cuda.*is_available"):
            check_device("cuda")


def test_the_protocol_is_name_and_run():
    class Echo:
        name = "echo"

        def run(self, dispatch, state):
            return DispatchResult({}, dict(state))

    assert isinstance(Echo(), Backend) and not isinstance(object(), Backend)
