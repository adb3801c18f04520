"""The Hopper GEMM tile body (interpreter/cuda/gemm_tile.cuh: TMA + mbarrier ring + wgmma through CuTe)
compiles for sm_90a with NVRTC, in the test kernel of scripts/dev/gemm_probe.py (the 64 x 128 tile only: ~6 s),
without spills or serialised wgmmas, and its machine code has wgmma in it. No GPU needed; skipped (one
reason) without NVRTC or the CUTLASS headers (the nvidia-cutlass wheel, or $CUTLASS_INCLUDE).
The GPU check and timing: ``python3 scripts/dev/gemm_probe.py`` on an H100 / H200."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[1] / "scripts" / "dev" / "gemm_probe.py"


def _probe():
    if "gemm_probe" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gemm_probe", PROBE)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gemm_probe"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["gemm_probe"]


def test_missing_cutlass_headers_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTLASS_INCLUDE", str(tmp_path))
    probe = _probe()
    with pytest.raises(probe.MissingHeaders) as e:
        probe.cutlass_include()
    assert "\n" not in str(e.value) and "CUTLASS headers not found" in str(e.value)


def test_gemm_tile_compiles_for_sm90a():
    probe = _probe()
    try:
        from cuda.bindings import nvrtc

        err, *_ = nvrtc.nvrtcVersion()
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    except Exception as e:  # the library or its bindings are missing
        pytest.skip(f"NVRTC cannot be loaded: {e}")
    try:
        probe.cutlass_include()
        probe.cccl_include()
    except probe.MissingHeaders as e:
        pytest.skip(str(e))
    res = probe.compile_probe(tiles=((64, 128),))
    log = res["log"]
    print(f"\nNVRTC {res['seconds']:.1f} s, cubin {len(res['cubin'])} bytes, machine code {probe.text_bytes(res['cubin'])}")
    assert "C7510" not in log and "serialized" not in log, f"ptxas serialised the wgmmas:\n{log}"
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert spills and not any(spills), f"the tile spills:\n{log}"
    assert probe.text_bytes(res["cubin"]).get("gemm_probe_64x128", 0) > 0
    counted = probe.wgmma_count(res["cubin"])
    if counted is not None:
        n, where = counted
        assert n >= 4, f"{where}: {n} (the 4 k-blocks of a stage)"
