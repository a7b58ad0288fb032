"""runtime/loading.py's dtype flag: ``auto`` is bf16 where the device computes bf16 products natively
and fp32 elsewhere (decided from the CPU's instruction sets, forced here both ways: never from the
machine at hand); named dtypes are taken as given; bad values are clear errors."""

import pytest
import torch

from dspark.cli import build_parser
from dspark.errors import UsageError
from dspark.runtime.loading import dtype_name, fast_dtype, parse_dtype


@pytest.mark.parametrize("avx512_bf16,amx,want", [(True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                                  (True, True, torch.bfloat16), (False, False, torch.float32)])
def test_auto_is_bf16_where_the_cpu_has_bf16_instructions_else_fp32(monkeypatch, avx512_bf16, amx, want):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert fast_dtype("cpu") == want == parse_dtype("auto") == parse_dtype("auto", "cpu")
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype("fp32") == torch.float32    # named: as given


def test_a_torch_without_the_probes_takes_fp32(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert fast_dtype("cpu") == torch.float32


def test_bad_dtypes_and_devices_are_clear_errors():
    with pytest.raises(UsageError, match="choose auto, bf16 or fp32"):
        parse_dtype("int8")
    with pytest.raises(UsageError, match="unknown device 'gpu0'"):
        parse_dtype("auto", "gpu0")
    assert dtype_name(torch.bfloat16) == "bf16" and dtype_name(torch.float32) == "fp32"


def test_the_model_commands_default_to_auto():
    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["serve"], ["profile"]):
        assert parser.parse_args(argv).dtype == "auto"
    assert parser.parse_args(["generate", "--prompt", "x", "--dtype", "fp32"]).dtype == "fp32"
