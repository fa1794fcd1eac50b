"""flashbridge.tiles: the resource model, its command line, the tuning cache and warm-up.

The estimates are checked against the compiler on a CPU: each candidate's launch (through the family's
plan, with the candidate as its config) is compiled for sm_90 without a GPU, and

* shared memory: the estimate equals Triton's allocation (``metadata.shared``) exactly; for the dK/dV
  kernel within 1 KB (the float32 lse / delta rows, whose buffer count the pipeliner picks per loop);
* spills: a surviving candidate compiles without local memory unless the model flags it as near the
  register cap (estimate >= 75% of it: there ptxas may spill a few bytes, e.g. the causal D=128 forward's
  default on Triton 3.9); a candidate estimated at >= 115% of the cap compiles with spills or at the cap;
* registers: the estimate is within REGS_TOLERANCE (70% to 140%) of what ptxas allocates or within
  REGS_SLACK registers of it -- unless ptxas sits at the 255 cap, where it fills every register it may have.

The default run compiles each kernel's model choice and plan default for one shape (Triton's on-disk cache
makes reruns cheap); ``-m slow`` compiles every survivor of every head dim.
"""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from flashbridge import tiles
from flashbridge.core_kernels import Target
from flashbridge.tiles import cache, cli
from flashbridge.tiles.model import MODELS, Tile, build_report

REGS_TOLERANCE = (0.7, 1.4)  # estimate / ptxas registers, where ptxas is below its cap ...
REGS_SLACK = 16  # ... or within this many registers (small kernels: addressing dominates)
OTHER_GPUS = ("A100", "L40S", "RTX 4090", "B200", "MI300X")

_DTYPES = {**{n: "bfloat16" for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv", "x", "weight", "y", "dy",
                                       "dx", "h", "logits", "grad", "k_cache", "v_cache")},
           **{n: "float32" for n in ("lse", "lse2", "delta", "dlse", "alibi_slopes", "sinks", "mean", "rstd",
                                     "dw_part", "db_part", "loss", "lse_lo", "dweight", "dbias", "k_scale",
                                     "v_scale", "residual", "post_residual", "bias")},
           **{n: "int32" for n in ("cu_seqlens_q", "cu_seqlens_k", "labels", "cache_seqlens", "block_table",
                                   "seed")}}


def _case(kernel: str, **kw):
    return cache.case_for(kernel, **kw)


# ------------------------------------------------------------------------------------------ the model itself

def test_profiles_by_name():
    assert tiles.profile("h200") is tiles.PROFILES["H200"]
    assert tiles.profile("NVIDIA H100 80GB HBM3").name == "H100"
    assert tiles.profile("rtx4090").name == "RTX 4090"
    with pytest.raises(ValueError, match="gpu: unknown GPU 'V100'"):
        tiles.profile("V100")
    for p in tiles.PROFILES.values():
        assert p.smem_per_block <= p.smem_per_sm and p.ridge > 0


@pytest.mark.parametrize("gpu", ("H200", *OTHER_GPUS))
@pytest.mark.parametrize("kernel", sorted(MODELS))
def test_every_kernel_has_a_table_on_every_profile(kernel, gpu):
    rep = tiles.report(kernel, gpu)
    kept = rep.survivors
    assert 1 <= len(kept) <= 6, [str(r.tile) for r in kept]
    assert rep.choice in kept and rep.default is not None
    for r in rep.rows:
        assert r.verdict in ("kept", "pruned")
        if r.verdict == "pruned":
            assert r.reason, r.tile
        if r.verdict == "kept":  # a survivor fits the GPU: shared memory, registers, at least one block
            assert r.est.smem <= rep.gpu.smem_per_block and r.est.blocks_per_sm >= 1


def test_h200_defaults_fit_and_other_gpus_get_their_own_choice():
    h200 = tiles.report("attention_fwd", "H200", head_dim=128)
    assert h200.default.verdict == "kept" and h200.choice.tile == h200.default.tile == Tile(128, 128, 8, 3)
    # the H200's forward tile needs 224 KB of shared memory: too much for an L40S (99 KB) or an A100; without
    # entries of their own, their plans take the model's choice
    for gpu in ("L40S", "A100"):
        rep = tiles.report("attention_fwd", gpu, head_dim=128)
        h200_tile = rep.row(Tile(128, 128, 8, 3))
        assert h200_tile.verdict == "pruned" and "shared memory" in h200_tile.reason
        assert rep.default.tile == rep.choice.tile and rep.choice.est.smem <= rep.gpu.smem_per_block


def test_fwd_shared_memory_formula_matches_the_known_default():
    """Known from the compiler (Triton 3.6 and 3.9, sm_90): the D=128 forward's default tile allocates
    q (128 x 128 bf16) + 3 stages of k and v (128 keys each) = 229376 bytes."""
    rep = tiles.report("attention_fwd", "H200", head_dim=128)
    assert rep.default.est.smem == 229376


def test_tiles_command_prints_the_table_and_explains(capsys):
    from flashbridge.__main__ import main

    assert main(["tiles", "flash_attention", "--head-dim", "128", "--gpu", "H200", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "attn_fwd_kernel" in out and "(128, 128, 8, 3)" in out
    assert "The default is the model's choice" in out
    for gpu in ("L40S", "MI300X"):  # GPUs we do not have: the table and the reasoning from their profiles
        assert main(["tiles", "flash_attention", "--head-dim", "128", "--gpu", gpu, "--explain"]) == 0
        out = capsys.readouterr().out
        assert "The H200's shipped tile (128, 128, 8, 3) is pruned on this GPU: shared memory" in out
        assert f"on the {gpu}" in out and "no tuned entry for this GPU" in out
    assert main(["tiles", "rms_norm", "--cols", "4096", "--gpu", "H100"]) == 0
    assert "norm_fwd_kernel" in capsys.readouterr().out
    assert main(["tiles", "flash_attention", "--gpu", "V100"]) == 2
    assert "gpu: unknown GPU 'V100'" in capsys.readouterr().err


def test_unknown_gpu_names_the_argument():
    with pytest.raises(ValueError, match="gpu: unknown GPU"):
        cli.resolve_gpu("nope")


# ------------------------------------------------------------------------------------ against the compiler

def _compiled_or_skip():
    from flashbridge.tiles import compiled

    why = compiled.available(90)
    if why:
        pytest.skip(why)
    return compiled


def _check_against_compiler(kernel: str, rows, case) -> list[str]:
    compiled = _compiled_or_skip()
    model = MODELS[kernel]
    failures = []
    for r in rows:
        launch = model.launch(case, Target(False, 132), model.config(r.tile))
        got = compiled.compile_launch(launch, _DTYPES)
        what = f"{kernel} {r.tile}: estimate smem {r.est.smem} regs {r.est.regs}, compiler smem {got.shared} " \
               f"regs {got.n_regs} spills {got.n_spills}"
        slack = 1024 if kernel == "attention_dkdv" else 0
        if not 0 <= got.shared - r.est.smem <= slack:
            failures.append(what + ": shared memory differs")
        if r.verdict == "pruned" and "spills" in r.reason:
            if r.est.regs >= 1.15 * 255 and not (got.n_spills or got.n_regs >= 255):
                failures.append(what + ": spills expected, none")
        else:
            if got.n_spills and not r.note:
                failures.append(what + ": spills")
            lo, hi = REGS_TOLERANCE
            if (got.n_regs < 255 and not lo <= r.est.regs / got.n_regs <= hi
                    and abs(r.est.regs - got.n_regs) > REGS_SLACK):
                failures.append(what + f": registers outside {REGS_TOLERANCE}")
    return failures


_SHAPES = [("attention_fwd", dict(head_dim=128)), ("attention_dq", dict(head_dim=128)),
           ("attention_dkdv", dict(head_dim=128)), ("decode", {}), ("norm_fwd", {}), ("norm_bwd", {}),
           ("cross_entropy", {})]


@pytest.mark.parametrize("kernel,kw", _SHAPES, ids=[k for k, _ in _SHAPES])
def test_estimates_match_the_compiler(kernel, kw):
    """The model's choice and the plan's default of each kernel, one shape, compiled for sm_90."""
    case = _case(kernel, **kw)
    rep = build_report(MODELS[kernel], case, tiles.PROFILES["H200"])
    rows = list({id(r): r for r in (rep.choice, rep.default)}.values())
    failures = _check_against_compiler(kernel, rows, case)
    assert not failures, "\n".join(failures)


_SLOW = [(k, dict(head_dim=d)) for k in ("attention_fwd", "attention_dq", "attention_dkdv") for d in (64, 128, 256)]
_SLOW += [("attention_fwd", dict(head_dim=128, causal=True)), ("decode", dict(batch=32, cache_len=8192)),
          ("norm_fwd", dict(rows=65536, cols=2048)), ("cross_entropy", dict(rows=256))]


@pytest.mark.slow
@pytest.mark.parametrize("kernel,kw", _SLOW, ids=[f"{k}-{kw}" for k, kw in _SLOW])
def test_every_survivor_matches_the_compiler(kernel, kw):
    case = _case(kernel, **kw)
    rep = build_report(MODELS[kernel], case, tiles.PROFILES["H200"])
    spilling = [r for r in rep.rows if "spills" in r.reason][:2]
    failures = _check_against_compiler(kernel, rep.survivors + spilling, case)
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------- the cache

@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHBRIDGE_CACHE", str(tmp_path))
    monkeypatch.setattr(cache, "shipped_file", lambda: tmp_path / "shipped.json")
    return tmp_path


def test_cache_keys_name_gpu_triton_op_and_bucket():
    gpu = tiles.PROFILES["H200"]
    a = cache.entry_key(gpu, "attention_fwd", _case("attention_fwd", head_dim=128, seqlen=4096), "3.6.0")
    assert a == "H200|sm90|triton 3.6.0|attention_fwd|d128-bfloat16-full-mha-s4k"
    assert cache.class_key(gpu, "attention_fwd", _case("attention_fwd", head_dim=96, seqlen=100_000), "3.6.0") == \
        "H200|sm90|triton 3.6.0|attention_fwd|d128-bfloat16-full-mha"
    # lengths within one bucket share an entry; masking, head dim, GPU and Triton version do not
    assert a == cache.entry_key(gpu, "attention_fwd", _case("attention_fwd", head_dim=128, seqlen=3000), "3.6.0")
    others = {cache.entry_key(gpu, "attention_fwd", _case("attention_fwd", head_dim=128, causal=True), "3.6.0"),
              cache.entry_key(gpu, "attention_fwd", _case("attention_fwd", head_dim=64), "3.6.0"),
              cache.entry_key(tiles.PROFILES["A100"], "attention_fwd", _case("attention_fwd", head_dim=128), "3.6.0"),
              cache.entry_key(gpu, "attention_fwd", _case("attention_fwd", head_dim=128), "3.9.0")}
    assert a not in others and len(others) == 4
    assert cache.shape_bucket(_case("norm_fwd", rows=16384, cols=8192), "norm_fwd") == "n8192-bfloat16-r16k"
    assert cache.shape_bucket(_case("decode", batch=32, cache_len=8192), "decode") == "narrow-L16k"
    assert cache.shape_bucket(_case("decode", batch=1, cache_len=8192), "decode") == "idle_contiguous-L16k"
    assert cache.shape_bucket(_case("cross_entropy", rows=8192), "cross_entropy") == "v131072-many"
    assert cache.shape_bucket(_case("attention_dkdv", head_dim=256), "attention_dkdv") == \
        "d256-bfloat16-full-mha-split2-s4k"


def test_cache_user_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHBRIDGE_CACHE", str(tmp_path / "x"))
    assert cache.user_cache_file() == tmp_path / "x" / "tiles.json"
    monkeypatch.delenv("FLASHBRIDGE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.user_cache_dir() == tmp_path / "xdg" / "flashbridge"


def test_lookup_falls_back_user_then_shipped_then_model(cache_dir):
    gpu = tiles.PROFILES["H200"]
    case = _case("attention_fwd", head_dim=128)
    key = cache.entry_key(gpu, "attention_fwd", case)
    model_tile = build_report(MODELS["attention_fwd"], case, gpu).choice.tile
    assert cache.lookup("attention_fwd", case, gpu) == (model_tile, "model")
    cache.store({key: cache.make_entry(Tile(64, 64, 4, 3), 1.0)}, cache.shipped_file())
    assert cache.lookup("attention_fwd", case, gpu) == (Tile(64, 64, 4, 3), "shipped")
    cache.store({key: cache.make_entry(Tile(128, 64, 8, 4), 0.9)})
    assert cache.lookup("attention_fwd", case, gpu) == (Tile(128, 64, 8, 4), "user cache")
    config = cache.config_for("attention_fwd", case, gpu)
    assert (config.block_m, config.block_n, config.num_warps, config.num_stages) == (128, 64, 8, 4)


def test_lookup_order_user_shipped_other_triton_model_and_lengths(cache_dir):
    """user (bucket, then class) > shipped of this Triton (bucket, then class) > shipped of the newest other
    Triton for the same GPU (bucket, then class) > the model; another GPU's entries never serve."""
    gpu, kernel = tiles.PROFILES["H200"], "attention_dq"
    case = _case(kernel, head_dim=64, seqlen=16384)
    key = lambda v, length=True: (cache.entry_key if length else cache.class_key)(gpu, kernel, case, v)  # noqa: E731
    t = [Tile(16 * (i + 1), 32, 4, 2) for i in range(7)]
    model_tile = build_report(MODELS[kernel], case, gpu).choice.tile
    assert cache.lookup(kernel, case, gpu, version="9.9.0") == (model_tile, "model")
    other_gpu = cache.entry_key(tiles.PROFILES["H100"], kernel, case, "9.9.0")
    cache.store({other_gpu: cache.make_entry(t[6], 1.0)}, cache.shipped_file())
    assert cache.lookup(kernel, case, gpu, version="9.9.0")[1] == "model"
    steps = [(cache.shipped_file(), key("3.5.0", False), "shipped (triton 3.5.0)"),
             (cache.shipped_file(), key("3.6.0", False), "shipped (triton 3.6.0)"),  # the newest other version
             (cache.shipped_file(), key("3.6.0"), "shipped (triton 3.6.0)"),  # a length bucket before its class
             (cache.shipped_file(), key("9.9.0", False), "shipped"),
             (cache.shipped_file(), key("9.9.0"), "shipped"),
             (None, key("9.9.0", False), "user cache")]
    for i, (path, k, source) in enumerate(steps):
        cache.store({k: cache.make_entry(t[i], 1.0)}, path)
        assert cache.lookup(kernel, case, gpu, version="9.9.0") == (t[i], source), k
    # a length outside every stored bucket takes the class entry
    long = _case(kernel, head_dim=64, seqlen=1 << 20)
    assert cache.lookup(kernel, long, gpu, version="9.9.0") == (t[5], "user cache")


def test_plans_read_the_cache_and_config_still_wins(cache_dir):
    """A user entry changes the tile a plan built afterwards takes (lookups are re-read when the file
    changes); configure() / a config's fields still win; the interpreter keeps its own tile."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig, plan_attention_fwd

    gpu = tiles.PROFILES["H200"]
    case = _case("attention_fwd", head_dim=64, seqlen=1024)
    target = Target(False, 132)

    def fwd_tile(config=None, t=target):
        launch = plan_attention_fwd(case.shape, case.options, target=t, config=config).launches[0]
        c = launch.constexpr_dict()
        return Tile(c["BLOCK_M"], c["BLOCK_N"], launch.num_warps, launch.num_stages)

    before = fwd_tile()
    cache.store({cache.entry_key(gpu, "attention_fwd", case): cache.make_entry(Tile(64, 32, 4, 4), 1.0)})
    assert fwd_tile() == Tile(64, 32, 4, 4) != before
    assert fwd_tile(AttentionConfig(num_warps=8)) == Tile(64, 32, 8, 4)
    assert fwd_tile(t=Target(True, 4)) == Tile(64, 64, 4, 1)
    # another GPU without entries: the model's choice for that GPU
    l40s = tiles.PROFILES["L40S"]
    assert fwd_tile(t=Target(False, l40s.sms, l40s)) == build_report(MODELS["attention_fwd"], case, l40s).choice.tile


def test_lookup_survives_a_broken_cache(cache_dir):
    gpu = tiles.PROFILES["H200"]
    case = _case("norm_fwd")
    cache.user_cache_file().write_text("{not json")
    cache.shipped_file().write_text(json.dumps({"entries": {cache.entry_key(gpu, "norm_fwd", case): {"tile": "x"}}}))
    with pytest.warns(UserWarning, match="unreadable"):
        tile, source = cache.lookup("norm_fwd", case, gpu)
    assert source == "model" and tile == build_report(MODELS["norm_fwd"], case, gpu).choice.tile


def _writer(args):
    path, worker, n = args
    from flashbridge.tiles import cache as c
    from flashbridge.tiles.model import Tile as T

    for i in range(n):
        c.store({f"w{worker}-{i}": c.make_entry(T(16, 16, 4, i % 4 + 1), float(i))}, path)
    return worker


def test_concurrent_writers_lose_no_entry(tmp_path):
    """Four processes each write 15 entries one at a time into one file: every entry survives (lock +
    merge-on-write) and the file is always whole JSON (temporary file + rename)."""
    path = tmp_path / "tiles.json"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert sorted(pool.map(_writer, [(path, w, 15) for w in range(4)])) == [0, 1, 2, 3]
    entries = cache.read_entries(path)
    assert len(entries) == 60 and entries["w3-14"]["tile"] == [16, 16, 4, 3]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_tune_on_a_cpu_says_so(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from flashbridge.__main__ import main

    assert main(["tune", "norms"]) == 1
    assert "no CUDA GPU is visible" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------- warm-up

def test_warmup_on_a_cpu_compiles_nothing(capsys):
    from flashbridge.tiles.warmup import gpu_visible

    if gpu_visible():
        pytest.skip("a GPU is visible")
    import flashbridge
    from flashbridge.__main__ import main

    assert flashbridge.warmup(ops=["norms"], hidden=[1024]) == 0
    assert "needs no compile" in capsys.readouterr().err
    assert main(["warmup", "--ops", "attention", "--head-dims", "64"]) == 0


def test_warmup_plans_cover_every_op():
    from flashbridge.tiles.warmup import plans

    seen = {what.split()[0] for what, _, _ in plans(("attention", "decode", "norms", "cross_entropy"), (128,),
                                                       ("bfloat16",))}
    assert seen == {"attention", "decode", "rms_norm", "layer_norm", "cross_entropy"}
    with pytest.raises(ValueError, match="ops: unknown"):
        list(plans(("rotary",), (128,), ("bfloat16",)))
