"""Max pooling as ops the code generator fuses: decompositions of ``max_pool2d_with_indices``
and its backward (the decomposition table, decompositions.py).

ATen's max pool is a kernel of its own, forward and backward: ResNet-50's stem pool at batch
128 took 417 us forward and 1133 us backward on the H200, Inductor's generated ones 187 and
729 us (session 46). Its forward writes int64 indices, 8 bytes for each output value, and its
backward is given the pool's input, which the forward must then keep for it.

Forward. Each window position (i, j) of a kh x kw window is a strided slice of the input padded
with -inf (index arithmetic in a kernel), and the value is the running ``maximum`` of the
kh * kw slices: NaN wherever the window holds one, as ATen's. The kernel that computes the
pool's input (a BatchNorm's normalisation and ReLU) computes it at each of those reads, so
that input need not be written at all. ATen's index is the window's first position, a
constant of the output position, plus where in the window the maximum lies, a second running
value:

    code = where((v > best) | isnan(v), i * dh * W + j * dw, code)   before best = maximum(best, v)

the first of equal maxima, the last NaN, as ATen's loop takes them (a value replaces the
maximum if it is greater or NaN). A window whose values are all -inf keeps ATen's first
position inside the input, which -inf padding never beats (neither greater nor NaN). ``code``
is int16 (int32 for rows of over 16K values), two bytes an output value where the index takes
eight; a training graph's backward needs the index, which aot_autograd's min-cut partitioner
then recomputes from ``code``. Inference graphs compute neither: nothing reads the index.

Backward. ATen scatters each output's gradient to the input position its index names. Here
each input element gathers instead: with dilation 1 the windows that may hold element h are
``(h + ph) // sh - t`` for t below ``ceil(kh / sh)`` (2 for 3 x 3 windows at stride 2, so 4
of the 9 windows in 2-d), and it takes each one's gradient where that window's index is its
own position ``h * W + w`` (a window's index lies inside it: one that does not hold the
element never matches). The windows are read by index arithmetic (each repeated ``sh`` times
by a reshape of an expand, shifted, zero-padded, sliced), summed in fp32 (ATen's CUDA kernel
accumulates in fp32 too). Index and position are compared in int32 where a plane has fewer
than 2**31 elements (the forward's index is summed in int32 and widened), half the registers
of int64 (ResNet's stem backward for sm_90, steps of 1024: 128 registers against 175).
Pointwise over the input's gradient: in ResNet's backward, inside the kernel of the
BatchNorm's backward. Where the index is recomputed in the kernel from the
forward's code, it is ``base + code`` at the window read. Session 47's first form compared
``index - base`` with each of the kh * kw window positions, each spread to where it lands
(``slices.spread``): nine masked reads of index and gradient an element; dilation > 1 keeps it.
It does not read the pool's input: the forward need not keep it.

Left to ATen (NotImplemented: traced as it is): integer inputs, symbolic sizes, windows of
over ``MAX_WINDOW`` positions, arguments ATen would refuse (its error), and inputs other than
[C, H, W] or [N, C, H, W].
"""
from __future__ import annotations

import torch

from .slices import pad_dim, spread

aten = torch.ops.aten

# the most window positions decomposed (Inductor's limit too: 5 x 5); wider windows, a global
# max pool written as one, keep ATen's op
MAX_WINDOW = 25


def _pair(v, default=None) -> tuple | None:
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return default
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return (v[0], v[0]) if len(v) == 1 else v if len(v) == 2 else None


def geometry(x, kernel_size, stride, padding, dilation, ceil_mode):
    """``((kh, kw), (sh, sw), (ph, pw), (dh, dw), (OH, OW))`` for a pool this module
    decomposes, else None."""
    if x.dim() not in (3, 4) or not x.dtype.is_floating_point:
        return None
    if not all(isinstance(s, int) for s in x.shape):
        return None                 # symbolic sizes: ATen's op
    k = _pair(kernel_size)
    s = _pair(stride, k)
    p = _pair(padding, (0, 0))
    d = _pair(dilation, (1, 1))
    if None in (k, s, p, d) or not all(isinstance(v, int) for t in (k, s, p, d) for v in t):
        return None
    if min(k) < 1 or min(s) < 1 or min(d) < 1 or min(p) < 0:
        return None
    if k[0] * k[1] > MAX_WINDOW:
        return None                 # a slice and a maximum each: the graph would grow
    out = []
    for n, kk, ss, pp, dd in zip(x.shape[-2:], k, s, p, d):
        span = dd * (kk - 1) + 1
        if pp * 2 > span:
            return None             # ATen's error: pad should be at most half the kernel
        o = (n + 2 * pp - span + (ss - 1 if ceil_mode else 0)) // ss + 1
        if ceil_mode and (o - 1) * ss >= n + pp:
            o -= 1                  # the last window must start inside the input or left pad
        if o < 1:
            return None
        out.append(o)
    return k, s, p, d, tuple(out)


def _windows(xp, k, s, d, out):
    """The kh * kw strided slices of padded ``xp``, window position (i, j) first by i."""
    for i in range(k[0]):
        rows = aten.slice(xp, -2, i * d[0], i * d[0] + s[0] * (out[0] - 1) + 1, s[0])
        for j in range(k[1]):
            yield i, j, aten.slice(rows, -1, j * d[1], j * d[1] + s[1] * (out[1] - 1) + 1, s[1])


def _right_pads(x, k, s, p, d, out):
    """Padding after the input along H and W: p, or more where ceil_mode's last window
    reaches past it."""
    return tuple(max(pp, (o - 1) * ss + dd * (kk - 1) + 1 - n - pp)
                 for n, kk, ss, pp, dd, o in zip(x.shape[-2:], k, s, p, d, out))


def _base(x, s, p, out):
    """ATen's index of each window's first position, h * W + w of the input (negative, or
    past a row's end, where the window starts in the padding)."""
    rows = torch.arange(out[0], device=x.device).view(out[0], 1) * s[0] - p[0]
    cols = torch.arange(out[1], device=x.device) * s[1] - p[1]
    return rows, cols, rows * x.shape[-1] + cols


def _steps(k, d, width):
    """Where each window position (i, j) lies from its window's start, in ATen's index:
    ``i * dh * W + j * dw`` (the forward's code, the backward's comparison)."""
    return [[i * d[0] * width + j * d[1] for j in range(k[1])] for i in range(k[0])]


def max_pool2d_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """``(values, indices)`` as ATen's (module docstring)."""
    got = geometry(x, kernel_size, stride, padding, dilation, ceil_mode)
    if got is None:
        return NotImplemented
    k, s, p, d, out = got
    right = _right_pads(x, k, s, p, d, out)
    xp = aten.constant_pad_nd(x, [p[1], right[1], p[0], right[0]], float("-inf"))
    rows, cols, base = _base(x, s, p, out)
    width = x.shape[-1]
    step = _steps(k, d, width)
    small = torch.int16 if step[-1][-1] < 2 ** 15 else torch.int32
    # the window's first position inside the input: ATen's index where no value beats -inf
    first = ((-rows).clamp_min(0) + d[0] - 1) // d[0] * d[0] * width \
        + ((-cols).clamp_min(0) + d[1] - 1) // d[1] * d[1]
    best = code = None
    for i, j, v in _windows(xp, k, s, d, out):
        if best is None:
            code = torch.where((v > float("-inf")) | torch.isnan(v), 0, first.to(small))
            best = v
            continue
        code = torch.where((v > best) | torch.isnan(v), step[i][j], code)
        best = torch.maximum(best, v)
    if x.shape[-2] * x.shape[-1] < 2 ** 31:
        # the sum in int32 (a backward that recomputes the index from ``code`` reads a 4-byte
        # base, and compares in int32: _gather_windows), widened to ATen's int64 after it
        return best, (base.to(torch.int32) + code.to(torch.int32)).to(torch.int64)
    return best, base + code.to(torch.int64)


def _window_back(t, dim: int, s: int, p: int, back: int, n: int):
    """``t`` (per window along ``dim``) at each of ``n`` input positions h: the value of
    window ``(h + p) // s - back``, zero where there is none. Index arithmetic: each window
    repeated ``s`` times (a reshape of an expand, as ``repeat``), shifted, padded, sliced."""
    dim %= t.dim()
    o = t.shape[dim]
    rep = t.unsqueeze(dim + 1).expand(t.shape[:dim + 1] + (s,) + t.shape[dim + 1:])
    rep = rep.reshape(t.shape[:dim] + (o * s,) + t.shape[dim + 1:])   # rep[j] = t[j // s]
    start = p - back * s            # rep's element at h = 0
    before, after = max(0, -start), max(0, start + n - o * s)
    if before or after:
        rep = pad_dim(rep, dim, before, after)
    return aten.slice(rep, dim, start + before, start + before + n)


def max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation,
                                     ceil_mode, indices):
    """The gradient of the pool's input, as ATen's (module docstring)."""
    got = geometry(x, kernel_size, stride, padding, dilation, ceil_mode)
    if got is None or tuple(grad.shape[-2:]) != got[4] or indices.shape != grad.shape:
        return NotImplemented
    k, s, p, d, out = got
    acc = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
    if d == (1, 1):
        total = _gather_windows(acc, x, k, s, p, out, indices)
    else:
        total = _spread_windows(acc, x, k, s, p, d, out, indices)
    return total.to(grad.dtype)


def _gather_windows(acc, x, k, s, p, out, indices):
    """Dilation 1: each input element (h, w) reads the ``ceil(kh / sh) * ceil(kw / sw)``
    windows that may hold it (4 for ResNet's 3 x 3 at stride 2), ``(h + ph) // sh - th`` by
    ``(w + pw) // sw - tw``, and takes each one's gradient where that window's index is its
    own position, ATen's ``h * W + w``: a window's index always lies inside it, so one that
    does not hold the element never matches. Reads by index arithmetic, no gather."""
    height, width = x.shape[-2:]
    position = (torch.arange(height, device=x.device) * width).view(-1, 1) \
        + torch.arange(width, device=x.device)
    if height * width < 2 ** 31:        # compared in int32: half the registers an index
        position, indices = position.to(torch.int32), indices.to(torch.int32)
    total = None
    for th in range(-(-k[0] // s[0])):
        g = _window_back(acc, -2, s[0], p[0], th, height)
        i = _window_back(indices, -2, s[0], p[0], th, height)
        for tw in range(-(-k[1] // s[1])):
            term = torch.where(_window_back(i, -1, s[1], p[1], tw, width) == position,
                               _window_back(g, -1, s[1], p[1], tw, width), 0.0)
            total = term if total is None else total + term
    return total


def _spread_windows(acc, x, k, s, p, d, out, indices):
    """Any dilation: for each of the kh * kw window positions, the gradients whose ``index -
    start`` is that position's step, spread to where it lands in the padded input, summed,
    the padding sliced off."""
    height, width = x.shape[-2:]
    right = _right_pads(x, k, s, p, d, out)
    base = _base(x, s, p, out)[2]
    offset = indices - base        # code, where the forward's index is computed here
    step = _steps(k, d, width)
    total = None
    for i in range(k[0]):
        for j in range(k[1]):
            g = torch.where(offset == step[i][j], acc, 0.0)
            g = spread(g, -2, s[0], i * d[0], height + p[0] + right[0])
            g = spread(g, -1, s[1], j * d[1], width + p[1] + right[1])
            total = g if total is None else total + g
    return aten.slice(aten.slice(total, -2, p[0], p[0] + height), -1, p[1], p[1] + width)
