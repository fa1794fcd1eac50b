"""Cross-entropy on a CUDA GPU in bfloat16 at the issue's shape (N=8192, H=4096, V=128256).

The float64 reference at that size is computed on the GPU with torch (chunked, the same formulas as
``flashbridge.reference.cross_entropy``); ``test_gpu_reference_matches_numpy_reference`` (CPU, small)
proves the two references agree. Errors follow tests/helpers.assert_close: at most twice the error of
eager bf16 autograd (``F.cross_entropy(h @ W.T)``) plus a floor, measured on the GPU to keep it fast.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

N, H, V = 8192, 4096, 128256
OPTION_SETS = [dict(), dict(label_smoothing=0.1, z_loss=1e-4, logit_softcap=30.0)]


def reference_f64(h, w, y, *, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  logit_softcap=0.0, class_weight=None, chunk=1024):
    """float64 (loss_mean, lse, dh, dw, db) of the mean-reduced linear cross-entropy, chunked over tokens;
    ``class_weight`` (V,): torch's class weights (the mean divides the ce terms by the counted labels'
    weights, the z-loss terms by their number)."""
    h64, w64 = h.double(), w.double()
    b64 = None if bias is None else bias.double()
    n, vocab = h.shape[0], w.shape[0]
    active = y != ignore_index
    count = max(int(active.sum()), 1)
    cw = None if class_weight is None else class_weight.double()
    w_total = count if cw is None else (float(cw[y[active]].sum()) if active.any() else 1.0)
    loss_sum = torch.zeros((), dtype=torch.float64, device=h.device)
    lse_all = torch.empty(n, dtype=torch.float64, device=h.device)
    dh = torch.empty_like(h64)
    dw = torch.zeros_like(w64)
    db = None if bias is None else torch.zeros_like(b64)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        x = h64[s:e] @ w64.T
        if b64 is not None:
            x = x + b64
        z = logit_softcap * torch.tanh(x / logit_softcap) if logit_softcap > 0 else x
        lse = torch.logsumexp(z, dim=-1)
        act = active[s:e]
        yy = torch.where(act, y[s:e], 0)
        z_y = z.gather(1, yy[:, None])[:, 0]
        if cw is None:
            w_y, smooth = torch.ones_like(lse), lse - z.mean(-1)
        else:
            w_y, smooth = cw[yy], (cw * (lse[:, None] - z)).sum(-1) / vocab
        ce = (1 - label_smoothing) * w_y * (lse - z_y) + label_smoothing * smooth
        loss_sum += torch.where(act, ce, 0.0).sum() / w_total + torch.where(act, z_loss * lse**2, 0.0).sum() / count
        lse_all[s:e] = lse
        p = torch.exp(z - lse[:, None])
        g_ce, g_z = act.double() / w_total, act.double() / count
        w_all = torch.ones(vocab, dtype=torch.float64, device=h.device) if cw is None else cw
        dz = g_ce[:, None] * ((1 - label_smoothing) * w_y[:, None] * p
                              + label_smoothing / vocab * (w_all.sum() * p - w_all))
        dz[torch.arange(e - s, device=h.device), yy] -= g_ce * (1 - label_smoothing) * w_y
        dz += (g_z * 2 * z_loss * lse)[:, None] * p
        if logit_softcap > 0:
            dz *= 1 - (z / logit_softcap) ** 2
        dh[s:e] = dz @ w64
        dw += dz.T @ h64[s:e]
        if db is not None:
            db += dz.sum(0)
    return loss_sum, lse_all, dh, dw, db


def naive_bf16(h, w, y, *, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0,
               class_weight=None):
    """Eager autograd in the input dtype: the yardstick of the error bound."""
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    x = h @ w.T
    if bias is not None:
        x = x + bias
    z = logit_softcap * torch.tanh(x / logit_softcap) if logit_softcap > 0 else x
    cw = None if class_weight is None else class_weight.to(z.dtype)
    rows = F.cross_entropy(z, y, weight=cw, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    active = y != ignore_index
    count = active.sum().clamp(min=1)
    w_total = count if cw is None else torch.where(active, cw[y.clamp(min=0)], 0).sum()
    loss = rows.sum() / w_total
    if z_loss:
        loss = loss + (z_loss * torch.logsumexp(z, -1) ** 2 * active).sum() / count
    dh, dw = torch.autograd.grad(loss, (h, w))
    return loss.detach(), dh, dw


def _max_err(a, ref):
    return (a.double() - ref).abs().max().item()


def assert_close_gpu(out, ref, naive, *, name, factor=2.0, floor=1e-5):
    """tests/helpers.assert_close, computed on the device."""
    err, naive_err = _max_err(out, ref), _max_err(naive, ref)
    scale = max(1.0, ref.abs().max().item())
    bound = factor * naive_err + floor * scale
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (naive bf16 error {naive_err:.3g})"
    return err, naive_err


def _inputs(seed, device="cuda", n=N, h=H, v=V):
    g = torch.Generator(device=device).manual_seed(seed)
    hid = torch.randn(n, h, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(v, h, generator=g, device=device) * (2.0 / h**0.5)).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), generator=g, device=device)
    y = torch.where(torch.rand(n, generator=g, device=device) < 0.1, -100, y)
    return hid, w, y


def test_gpu_reference_matches_numpy_reference():
    """CPU, small: the chunked torch float64 reference used on the GPU equals the NumPy reference."""
    from flashbridge.reference import cross_entropy as R

    hid, w, y = _inputs(0, device="cpu", n=37, h=16, v=300)
    b = torch.randn(300, dtype=torch.float64)
    opts = OPTION_SETS[1]
    loss, lse, dh, dw, db = reference_f64(hid, w, y, bias=b, chunk=8, **opts)
    hn, wn, yn = hid.double().numpy(), w.double().numpy(), y.numpy()
    rl, rlse = R.linear_cross_entropy(hn, wn, yn, bias=b.numpy(), return_lse=True, **opts)
    rdh, rdw, rdb = R.linear_cross_entropy_bwd(1.0, hn, wn, yn, bias=b.numpy(), **opts)
    for a, r in ((loss, rl), (lse, rlse), (dh, rdh), (dw, rdw), (db, rdb)):
        np.testing.assert_allclose(a.numpy(), r, rtol=1e-10, atol=1e-13)
    cw = torch.rand(300, dtype=torch.float64) + 0.5
    loss, lse, dh, dw, db = reference_f64(hid, w, y, bias=b, chunk=8, class_weight=cw, **opts)
    rl = R.linear_cross_entropy(hn, wn, yn, bias=b.numpy(), class_weight=cw.numpy(), **opts)
    rdh, rdw, rdb = R.linear_cross_entropy_bwd(1.0, hn, wn, yn, bias=b.numpy(), class_weight=cw.numpy(), **opts)
    for a, r in ((loss, rl), (dh, rdh), (dw, rdw), (db, rdb)):
        np.testing.assert_allclose(a.numpy(), r, rtol=1e-10, atol=1e-13)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", OPTION_SETS, ids=["plain", "smooth-zloss-softcap"])
def test_linear_cross_entropy_bf16_h200_shape(opts):
    from flashbridge.torch_api.cross_entropy import linear_cross_entropy

    hid, w, y = _inputs(1)
    ref_loss, ref_lse, ref_dh, ref_dw, _ = reference_f64(hid, w, y, **opts)
    n_loss, n_dh, n_dw = naive_bf16(hid, w, y, **opts)
    ht, wt = hid.clone().requires_grad_(), w.clone().requires_grad_()
    loss, lse = linear_cross_entropy(ht, wt, y, return_lse=True, **opts)
    loss.backward()
    rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    assert loss.dtype == torch.float32 and rel <= 1e-3, f"loss relative error {rel:.3g}"
    assert (lse.double() - ref_lse).abs().max().item() <= 0.05
    assert_close_gpu(ht.grad, ref_dh, n_dh, name="dhidden")
    assert_close_gpu(wt.grad, ref_dw, n_dw, name="dweight")
    del n_loss


@pytest.mark.gpu
def test_linear_cross_entropy_bf16_sum_and_deterministic():
    """reduction="sum" makes the gradients O(1), so the floor no longer hides anything; and two runs give
    the same bits."""
    from flashbridge.torch_api.cross_entropy import linear_cross_entropy

    hid, w, y = _inputs(2, n=2048)
    _, _, ref_dh, ref_dw, _ = reference_f64(hid, w, y)
    count = (y != -100).sum().item()
    runs = []
    for _ in range(2):
        ht, wt = hid.clone().requires_grad_(), w.clone().requires_grad_()
        linear_cross_entropy(ht, wt, y, reduction="sum", chunk_size=512).backward()
        runs.append((ht.grad, wt.grad))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    hn, wn = hid.detach().requires_grad_(), w.detach().requires_grad_()
    F.cross_entropy(hn @ wn.T, y, reduction="sum").backward()
    assert_close_gpu(runs[0][0], ref_dh * count, hn.grad, name="dhidden (sum)")
    assert_close_gpu(runs[0][1], ref_dw * count, wn.grad, name="dweight (sum)")


@pytest.mark.gpu
def test_cross_entropy_logits_bf16_h200_shape():
    from flashbridge.torch_api.cross_entropy import cross_entropy

    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(N, V, generator=g, device="cuda") * 3).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), generator=g, device="cuda")
    xt = x.clone().requires_grad_()
    loss = cross_entropy(xt, y)
    loss.backward()
    x64 = x.double()
    ref = F.cross_entropy(x64, y)
    rel = abs(loss.item() - ref.item()) / abs(ref.item())
    assert rel <= 1e-3, f"loss relative error {rel:.3g}"
    xn = x.clone().requires_grad_()
    F.cross_entropy(xn, y).backward()
    x64.requires_grad_()
    F.cross_entropy(x64, y).backward()
    assert_close_gpu(xt.grad, x64.grad, xn.grad, name="dlogits")


@pytest.mark.gpu
def test_torch_jax_parity_on_gpu():
    pytest.importorskip("jax_triton")
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.cross_entropy import cross_entropy as jce
    from flashbridge.torch_api.cross_entropy import cross_entropy as tce

    g = torch.Generator(device="cuda").manual_seed(4)
    x = (torch.randn(256, 32003, generator=g, device="cuda") * 3).to(torch.bfloat16)
    y = torch.randint(0, 32003, (256,), generator=g, device="cuda")
    xt = x.clone().requires_grad_()
    loss = tce(xt, y, label_smoothing=0.1, reduction="none")
    loss.sum().backward()
    xj = jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16)
    yj = jnp.asarray(y.cpu().numpy())
    jl, jg = jax.value_and_grad(lambda a: jce(a, yj, label_smoothing=0.1, reduction="none").sum())(
        jax.device_put(xj, jax.devices("gpu")[0]))
    assert np.array_equal(np.asarray(jg.astype(jnp.float32)), xt.grad.float().cpu().numpy())
    np.testing.assert_allclose(float(jl), loss.sum().item(), rtol=1e-6)


@pytest.mark.gpu
def test_jax_linear_cross_entropy_on_gpu():
    """The JAX linear op on the GPU (its chunk gradient takes over the logits' buffer) against the float64
    reference, several chunks and a tail chunk."""
    pytest.importorskip("jax_triton")
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.cross_entropy import linear_cross_entropy as jlce

    hid, w, y = _inputs(5, n=1000, h=512, v=32003)
    ref_loss, _, ref_dh, ref_dw, _ = reference_f64(hid, w, y)
    _, n_dh, n_dw = naive_bf16(hid, w, y)
    dev = jax.devices("gpu")[0]
    hj, wj = (jax.device_put(jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16), dev) for t in (hid, w))
    yj = jax.device_put(jnp.asarray(y.cpu().numpy()), dev)
    loss, (dh, dw) = jax.jit(jax.value_and_grad(lambda a, b: jlce(a, b, yj, chunk_size=256), argnums=(0, 1)))(hj, wj)
    assert abs(float(loss) - ref_loss.item()) / abs(ref_loss.item()) <= 1e-3
    to_torch = lambda a: torch.from_numpy(np.asarray(a.astype(jnp.float32))).to("cuda")  # noqa: E731
    assert_close_gpu(to_torch(dh), ref_dh, n_dh, name="dhidden (jax)")
    assert_close_gpu(to_torch(dw), ref_dw, n_dw, name="dweight (jax)")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [256, None], ids=["chunks", "in-dW"])
def test_jax_linear_cross_entropy_keeps_no_logits_copy(chunk_size):
    """XLA's optimized program of the JAX linear op (value_and_grad; 256-token chunks plus a tail, or the
    default: chunks of H tokens inside the dW-shaped buffer, then the tail) copies no chunk of logits and
    not the buffer: the gradient kernel works in place on the GEMM's output, and the forward kernel runs
    once per chunk (dynamic-slice fusion kept away from our kernel calls, see ``_pass1``). Compiled only,
    not run."""
    pytest.importorskip("jax_triton")
    import re

    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.cross_entropy import linear_cross_entropy as jlce

    n, h, v = 1000, 256, 4096
    args = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16), jax.ShapeDtypeStruct((v, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((n,), jnp.int32))
    fn = jax.value_and_grad(lambda a, b, c: jlce(a, b, c, chunk_size=chunk_size, validate_labels=False),
                            argnums=(0, 1))
    text = jax.jit(fn).lower(*args).compile().as_text()
    assert not re.search(rf"= bf16\[\d+,{v}\]\{{1,0\}} copy\(", text), "a copy of a chunk's logits"
    assert not re.search(rf"= bf16\[{v},{h}\]\{{1,0\}} copy\(", text), "a copy of the dW-shaped buffer"
    # a fusion computation taking a chunk of logits: one of our kernel calls wrapped with slices
    assert not re.search(rf"^%dynamic-slice-fusion[.\d]* \([^)]*bf16\[\d+,{v}\]", text, re.M), \
        "a kernel call inside a dynamic-slice fusion"


@pytest.mark.gpu
def test_gpu_labels_checked_only_when_asked():
    """On a GPU the default (validate_labels=None) does not read the labels back (no host sync): a label
    outside [0, V) gives its row a NaN loss, the other rows are untouched; True still raises. Both
    frameworks."""
    from flashbridge.torch_api.cross_entropy import cross_entropy as tce

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4, 1000, generator=g, device="cuda").to(torch.bfloat16)
    y = torch.tensor([3, 1000, -100, 999], device="cuda")
    good = torch.tensor([3, 0, -100, 999], device="cuda")
    rows = tce(x, y, reduction="none")
    want = tce(x, good, reduction="none")
    assert torch.isnan(rows[1]) and torch.equal(rows[[0, 2, 3]], want[[0, 2, 3]])
    with pytest.raises(ValueError, match="labels: 1 label"):
        tce(x, y, validate_labels=True)
    try:
        import jax_triton  # noqa: F401  (the JAX path's launcher)
    except ImportError:
        return
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.cross_entropy import cross_entropy as jce

    gpu = jax.devices("gpu")[0]
    xj = jax.device_put(jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16), gpu)
    yj = jax.device_put(jnp.asarray(y.cpu().numpy()), gpu)
    jrows = np.asarray(jce(xj, yj, reduction="none"))
    assert np.isnan(jrows[1]) and np.array_equal(jrows[[0, 2, 3]], want[[0, 2, 3]].cpu().numpy())
    with pytest.raises(ValueError, match="labels: 1 label"):
        jce(xj, yj, validate_labels=True)


# ---------------------------------------------------------------------- class weights, accuracy, argmax

@pytest.mark.gpu
def test_weighted_cross_entropy_logits_bf16_h200_shape():
    """The logits op at N=8192, V=128256 with class weights, label smoothing, a z-loss and the extras:
    loss and dlogits against float64 within twice eager bf16's error, the argmax equal to torch.argmax."""
    from flashbridge.torch_api.cross_entropy import cross_entropy

    g = torch.Generator(device="cuda").manual_seed(11)
    x = (torch.randn(N, V, generator=g, device="cuda") * 3).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), generator=g, device="cuda")
    y[::7] = -100
    w = (torch.rand(V, generator=g, device="cuda") * 2 + 0.1).to(torch.bfloat16).float()  # exact in bf16
    opts = dict(label_smoothing=0.1, z_loss=1e-4)
    xt = x.clone().requires_grad_()
    out = cross_entropy(xt, y, weight=w, return_accuracy=True, return_predicted=True, **opts)
    out.loss.backward()
    # float64 reference (torch's weighted smoothing; the z-loss over the counted tokens) and eager bf16
    active = y != -100
    x64 = x.double().requires_grad_()
    ref = (F.cross_entropy(x64, y, weight=w.double(), label_smoothing=0.1)
           + 1e-4 * (torch.logsumexp(x64, -1) ** 2 * active).sum() / active.sum())
    ref.backward()
    xn = x.clone().requires_grad_()
    naive = (F.cross_entropy(xn, y, weight=w.to(torch.bfloat16), label_smoothing=0.1)
             + 1e-4 * (torch.logsumexp(xn.float(), -1) ** 2 * active).sum() / active.sum())
    naive.backward()
    rel = abs(out.loss.item() - ref.item()) / abs(ref.item())
    assert rel <= 1e-3, f"loss relative error {rel:.3g}"
    assert_close_gpu(xt.grad, x64.grad, xn.grad, name="dlogits (weighted)")
    predicted = torch.argmax(x, -1)
    assert torch.equal(out.predicted, predicted)
    assert torch.equal(out.accuracy, (predicted == y) & active)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", OPTION_SETS, ids=["plain", "smooth-zloss-softcap"])
def test_weighted_linear_cross_entropy_bf16_h200_shape(opts):
    from flashbridge.torch_api.cross_entropy import linear_cross_entropy

    hid, w, y = _inputs(12)
    cw = (torch.rand(V, generator=torch.Generator(device="cuda").manual_seed(13), device="cuda") * 2 + 0.1)
    cw = cw.to(torch.bfloat16).float()
    ref_loss, _, ref_dh, ref_dw, _ = reference_f64(hid, w, y, class_weight=cw, **opts)
    _, n_dh, n_dw = naive_bf16(hid, w, y, class_weight=cw, **opts)
    ht, wt = hid.clone().requires_grad_(), w.clone().requires_grad_()
    out = linear_cross_entropy(ht, wt, y, class_weight=cw, return_predicted=True, **opts)
    out.loss.backward()
    rel = abs(out.loss.item() - ref_loss.item()) / abs(ref_loss.item())
    assert rel <= 1e-3, f"loss relative error {rel:.3g}"
    assert_close_gpu(ht.grad, ref_dh, n_dh, name="dhidden (weighted)")
    assert_close_gpu(wt.grad, ref_dw, n_dw, name="dweight (weighted)")
    # the argmax of the bf16 logits pass 1 computes: within their rounding (2^-7 relative) of the maximum of
    # the same logits in float32
    logits = hid[:1024].float() @ w.float().T
    picked = logits.gather(1, out.predicted[:1024, None])[:, 0]
    top = logits.max(-1).values
    assert (picked >= top - 2.0**-7 * top.abs().clamp(min=1)).all()


PARITY_CASES = [  # class weights?, options
    (False, dict()),
    (False, dict(z_loss=1e-3)),
    (True, dict()),
    (True, dict(label_smoothing=0.1, z_loss=1e-3)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("weighted,opts", PARITY_CASES, ids=["mean", "mean-zloss", "weighted", "weighted-smooth-zloss"])
def test_weighted_torch_jax_parity_on_gpu(weighted, opts):
    """Reduction "mean" with and without class weights, smoothing, z-loss and the extras: torch and JAX give
    the same bits on the GPU, loss and gradient. A mean multiplies by the reciprocals of its divisors from
    one kernel (IEEE division): XLA's own float32 division on NVIDIA GPUs is approximate (div.full.f32),
    torch's is not, and dividing there made ~100-240 gradient elements differ by one bf16 ulp. The rows
    are summed by one kernel too (each framework's own sum reduces in its own order)."""
    pytest.importorskip("jax_triton")
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.cross_entropy import cross_entropy as jce
    from flashbridge.torch_api.cross_entropy import cross_entropy as tce

    g = torch.Generator(device="cuda").manual_seed(14)
    x = (torch.randn(256, 32003, generator=g, device="cuda") * 3).to(torch.bfloat16)
    y = torch.randint(0, 32003, (256,), generator=g, device="cuda")
    y[::5] = -100
    y[1::7] = -100  # 174 counted labels: a count whose reciprocal is not a power of two
    w = torch.rand(32003, generator=g, device="cuda") + 0.5
    kw = dict(weight=w) if weighted else {}
    xt = x.clone().requires_grad_()
    out = tce(xt, y, return_predicted=True, return_accuracy=True, **kw, **opts)
    out.loss.backward()
    dev = jax.devices("gpu")[0]
    xj = jax.device_put(jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16), dev)
    yj, wj = (jax.device_put(jnp.asarray(t.cpu().numpy()), dev) for t in (y, w))
    jkw = dict(weight=wj) if weighted else {}

    def f(a):
        o = jce(a, yj, return_predicted=True, return_accuracy=True, **jkw, **opts)
        return o.loss, o

    (jl, jout), jg = jax.value_and_grad(f, has_aux=True)(xj)
    jg, tg = np.asarray(jg.astype(jnp.float32)), xt.grad.float().cpu().numpy()
    assert np.array_equal(jg, tg), f"{int((jg != tg).sum())} of {tg.size} gradient elements differ"
    assert np.float32(jl).tobytes() == np.float32(out.loss.item()).tobytes(), (float(jl), out.loss.item())
    assert np.array_equal(np.asarray(jout.predicted), out.predicted.cpu().numpy())
    assert np.array_equal(np.asarray(jout.accuracy), out.accuracy.cpu().numpy())


@pytest.mark.gpu
def test_jax_weighted_linear_cross_entropy_on_gpu():
    pytest.importorskip("jax_triton")
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.cross_entropy import linear_cross_entropy as jlce

    hid, w, y = _inputs(15, n=1000, h=512, v=32003)
    cw = (torch.rand(32003, generator=torch.Generator(device="cuda").manual_seed(16), device="cuda") + 0.5)
    ref_loss, _, ref_dh, ref_dw, _ = reference_f64(hid, w, y, class_weight=cw, label_smoothing=0.1)
    _, n_dh, n_dw = naive_bf16(hid, w, y, class_weight=cw, label_smoothing=0.1)
    dev = jax.devices("gpu")[0]
    hj, wj = (jax.device_put(jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16), dev) for t in (hid, w))
    yj, cwj = (jax.device_put(jnp.asarray(t.cpu().numpy()), dev) for t in (y, cw))
    loss, (dh, dw) = jax.jit(jax.value_and_grad(lambda a, b: jlce(a, b, yj, class_weight=cwj, label_smoothing=0.1),
                                                argnums=(0, 1)))(hj, wj)
    assert abs(float(loss) - ref_loss.item()) / abs(ref_loss.item()) <= 1e-3
    to_torch = lambda a: torch.from_numpy(np.asarray(a.astype(jnp.float32))).to("cuda")  # noqa: E731
    assert_close_gpu(to_torch(dh), ref_dh, n_dh, name="dhidden (jax, weighted)")
    assert_close_gpu(to_torch(dw), ref_dw, n_dw, name="dweight (jax, weighted)")
