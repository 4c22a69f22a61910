# Copyright 2026 The trace-hf Authors. Licensed under the Apache License, Version 2.0.
"""The FP4 formats, in plain torch. This module is the specification.

Every Triton kernel in `trace_hf.kernels` must reproduce these functions bit for bit (codes, scale bytes and
dequantized values), and rollout and training both quantize through the functions here, so that the only
difference left between the two sides is how the activations were computed.

Formats (docs/numerics.md says why each rule is what it is):

* E2M1 code = ``sign << 3 | index``, magnitudes by index 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; round to nearest
  even, saturating at 6; -0 and negative values that round to zero keep the sign (code 0x8).
* NVFP4: blocks of 16 along the last dimension; fp32 global scale ``g = amax / (6 * 448)`` over a row, an
  expert or the whole tensor; E4M3 block scale ``s = E4M3((amax_block / 6) / g)`` (RNE, saturating at 448,
  subnormals kept); ``code = E2M1(clamp(x / (s * g), -6, 6))``; ``value = (E2M1(code) * s) * g``.
* MXFP4: blocks of 32, E8M0 block scale ``2 ** clamp(floor(log2(amax_block)) - 2, -127, 127)`` (the OCP rule),
  no global scale (ones).
* Zeros: a group with amax 0 has g = 0 and scale bytes 0; an NVFP4 block whose scale underflows E4M3 (rounds
  to 0) flushes to zero. Flushed elements keep their sign (codes 0x0 / 0x8).
* NaN/Inf: a non-finite input poisons its whole scale group (row, expert or tensor for NVFP4; block for
  MXFP4): its scale bytes become the NaN encoding (0x7F E4M3, 0xFF E8M0), its codes keep only the sign bit, and it
  dequantizes to NaN. Nothing non-finite ever turns into finite values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: E2M1 magnitude of each index 0..7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_NAN_BYTE = 0x7F
E8M0_NAN_BYTE = 0xFF


@dataclass(frozen=True)
class FP4Format:
    """What differs between the two block formats."""

    name: str
    block_size: int
    has_global_scale: bool


FORMATS: dict[str, FP4Format] = {
    "nvfp4": FP4Format("nvfp4", 16, True),
    "mxfp4": FP4Format("mxfp4", 32, False),
}


def get_format(fmt: str) -> FP4Format:
    if fmt not in FORMATS:
        raise ValueError(f"Unknown FP4 format {fmt!r}: use one of {sorted(FORMATS)}.")
    return FORMATS[fmt]


def check_last_dim(x: torch.Tensor, fmt: str) -> FP4Format:
    f = get_format(fmt)
    if x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % f.block_size != 0:
        raise ValueError(
            f"{f.name} quantizes blocks of {f.block_size} along the last dimension, but the input has shape "
            f"{tuple(x.shape)}; pad or choose a last dimension that is a non-zero multiple of {f.block_size}."
        )
    return f


def check_input(x: torch.Tensor, fmt: str) -> FP4Format:
    """What every quantizer (torch and Triton) accepts: a floating-point tensor whose values fit fp32, the dtype
    all scales are computed in, with a last dimension of whole blocks."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"FP4 quantization takes floating-point tensors, got {getattr(x, 'dtype', type(x))}: the result comes "
            "back in the input's dtype, which would truncate it; convert with x.float() (or x.to(torch.bfloat16))."
        )
    f = check_last_dim(x, fmt)
    if x.dtype == torch.float64 and x.numel() and bool((torch.isinf(x.float()) & torch.isfinite(x)).any()):
        raise ValueError(
            "The float64 input has finite values beyond the float32 range (|x| > 3.4e38), where the fp32 scales of "
            "FP4 overflow and would turn their whole scale group into NaN; scale the tensor down or clamp it to "
            "torch.finfo(torch.float32).max first."
        )
    return f


SCALE_MODES = ("row", "tensor", "expert")


def check_scale(x: torch.Tensor, scale: str) -> None:
    """Validate the scale mode for every format, so a call that is valid for one format is valid for the other (the
    mode picks the NVFP4 global-scale group; MXFP4 has only per-block scales, which no mode changes)."""
    if not isinstance(scale, str) or scale not in SCALE_MODES:
        raise ValueError(f"Unknown scale mode {scale!r}: use 'row', 'tensor' or 'expert'.")
    if scale == "expert" and x.ndim < 2:
        raise ValueError("scale='expert' needs a tensor with a leading expert dimension, e.g. [E, N, K].")


def check_hints(x: torch.Tensor, hints: FP4Hints) -> FP4Format:
    """Hints must match the input exactly (the torch path would otherwise broadcast a malformed hint silently):
    uint8 bits [..., K / 8] and scale bytes [..., K / block], and an fp32 global scale per row, [..., 1] (or a
    size-1 dimension shared by rows, as a tensor or expert scale is)."""
    f = check_input(x, hints.fmt)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if hints.width != k or tuple(hints.block_scale.shape[:-1]) != lead:
        raise ValueError(
            f"Hints of width {hints.width} and rows {tuple(hints.block_scale.shape[:-1])} do not fit an input of "
            f"shape {tuple(x.shape)}: hints must be taken at the same site, token and width."
        )
    for name, t, want in (
        ("mantissa_bits", hints.mantissa_bits, lead + (k // 8,)),
        ("block_scale", hints.block_scale, lead + (k // f.block_size,)),
    ):
        if t.dtype != torch.uint8:
            raise TypeError(
                f"FP4Hints.{name} must be the raw uint8 bytes of the rollout, got {t.dtype}; keep hints in uint8 "
                "(move them with .to(device), never .to(dtype))."
            )
        if tuple(t.shape) != want:
            raise ValueError(
                f"FP4Hints.{name} has shape {tuple(t.shape)} but an input of shape {tuple(x.shape)} needs {want} "
                f"({f.name}); the hints do not fit: take them at the same site, token and width."
            )
    g = hints.global_scale
    if g.dtype != torch.float32:
        raise TypeError(f"FP4Hints.global_scale must be float32 (the rollout's fp32 row scales), got {g.dtype}.")
    if g.ndim != x.ndim or g.shape[-1] != 1 or any(a not in (b, 1) for a, b in zip(g.shape[:-1], lead)):
        raise ValueError(
            f"FP4Hints.global_scale has shape {tuple(g.shape)} for an input of shape {tuple(x.shape)}: give one fp32 "
            f"scale per row, shaped {lead + (1,)} (e.g. global_scale.unsqueeze(-1))."
        )
    return f


# ----------------------------------------------------------------------------------------------------------
# Scalar formats
# ----------------------------------------------------------------------------------------------------------


def e2m1_index(a: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even index 0..7 of magnitudes ``a >= 0`` (values above 6 saturate to 7).

    The thresholds alternate ``>`` and ``>=`` so that every tie goes to the even index.
    """
    idx = (a > 0.25).to(torch.uint8)
    idx += a >= 0.75
    idx += a > 1.25
    idx += a >= 1.75
    idx += a > 2.5
    idx += a >= 3.5
    idx += a > 5.0
    return idx


@functools.cache
def _e2m1_signed_table(device: torch.device) -> torch.Tensor:
    """fp32 value of each code 0..15 (codes 8..15 are the negatives, 8 being -0)."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.cat([mags, -mags]).to(device)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of uint8 E2M1 codes (sign in bit 3)."""
    return _e2m1_signed_table(codes.device)[codes.long()]


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """Raw E4M3 (float8_e4m3fn) bytes of fp32 ``v >= 0``: round to nearest even, saturating at 448, NaN -> 0x7F."""
    byte = v.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(v), torch.full_like(byte, E4M3_NAN_BYTE), byte)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    return b.view(torch.float8_e4m3fn).to(torch.float32)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2 ** e`` for integer ``e`` in [-127, 127], built from the bits (``exp2`` need not be exact)."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    return torch.where(e == -127, torch.full_like(normal, 2.0**-127), normal)


def e8m0_decode(b: torch.Tensor) -> torch.Tensor:
    v = pow2(b.to(torch.int32) - 127)
    return torch.where(b == E8M0_NAN_BYTE, torch.full_like(v, float("nan")), v)


def block_scale_decode(b: torch.Tensor, fmt: str) -> torch.Tensor:
    return e4m3_decode(b) if get_format(fmt).has_global_scale else e8m0_decode(b)


# ----------------------------------------------------------------------------------------------------------
# Containers
# ----------------------------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte: element 2i in the low nibble, 2i+1 in the high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Eight 0/1 values per byte: element 8j+b at bit b."""
    b = bits.to(torch.uint8).unflatten(-1, (-1, 8))
    # The shifts from arange, not a tensor built from a list: that is a host-to-device copy, which on CUDA syncs
    # (24 syncs per prefill of Qwen3-30B-A3B under hint recording, 45 ms of GPU idle: docs/lab-notes.md 8).
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (b << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


@dataclass
class FP4Tensor:
    """A quantized tensor: packed codes, raw block-scale bytes and the fp32 global scale.

    ``global_scale`` broadcasts against ``[..., K / block]`` (``[..., 1]`` per row, ``[E, 1, 1]`` per expert,
    all-ones shape per tensor); MXFP4 has ones there so that both formats dequantize the same way.
    """

    packed: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    fmt: str = "nvfp4"

    @property
    def shape(self) -> torch.Size:
        return self.packed.shape[:-1] + (self.packed.shape[-1] * 2,)

    def codes(self) -> torch.Tensor:
        return unpack_codes(self.packed)

    def scales(self) -> torch.Tensor:
        """fp32 ``s * g`` per block, ``[..., K / block]``."""
        return block_scale_decode(self.block_scale, self.fmt) * self.global_scale

    def check_layout(self) -> FP4Format:
        """The format's block must tile the codes: a container written in the other format (NVFP4 blocks of 16, MXFP4
        blocks of 32) carries twice or half the scale bytes, which would misread every value."""
        f = get_format(self.fmt)
        k, blocks = self.packed.shape[-1] * 2, self.block_scale.shape[-1]
        if self.packed.shape[:-1] == self.block_scale.shape[:-1] and blocks * f.block_size == k:
            return f
        other = [g.name for g in FORMATS.values() if g.name != f.name and blocks * g.block_size == k]
        written = f"written in {other[0]} (blocks of {FORMATS[other[0]].block_size})" if other else "of another layout"
        raise ValueError(
            f"This FP4Tensor says fmt={f.name!r} (blocks of {f.block_size}), but its {k} codes per row come with "
            f"{blocks} block scales {tuple(self.block_scale.shape)}: a container {written}. Read it with the format "
            f"it was quantized in{f' (fmt={other[0]!r})' if other else ''}, or quantize again in {f.name}."
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        bs = self.check_layout().block_size
        q = e2m1_decode(self.codes()).unflatten(-1, (-1, bs))
        s = block_scale_decode(self.block_scale, self.fmt).unsqueeze(-1)
        g = self.global_scale.unsqueeze(-1)
        return ((q * s) * g).flatten(-2).to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.block_scale, self.global_scale))


@dataclass
class FP4Hints:
    """What a rollout keeps of a quantized activation so that training can round the same way.

    ``mantissa_bits``: the mantissa bit (``code & 1``) of every element, 8 per byte, ``[..., K / 8]``;
    ``block_scale``: the raw scale bytes; ``global_scale``: fp32 per row (``[..., 1]``).
    """

    mantissa_bits: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    fmt: str = "nvfp4"

    @property
    def width(self) -> int:
        return self.mantissa_bits.shape[-1] * 8

    def nbytes_per_row(self) -> int:
        """Bytes a row of hints takes: K/8 + K/block + 4 (NVFP4) or K/8 + K/32 (MXFP4)."""
        per_row = self.mantissa_bits.shape[-1] + self.block_scale.shape[-1]
        return per_row + (4 if get_format(self.fmt).has_global_scale else 0)


def hint_bytes_per_row(width: int, fmt: str = "nvfp4") -> int:
    f = get_format(fmt)
    return width // 8 + width // f.block_size + (4 if f.has_global_scale else 0)


# ----------------------------------------------------------------------------------------------------------
# The reference quantizer
# ----------------------------------------------------------------------------------------------------------


def _group_max(a: torch.Tensor, scale: str) -> torch.Tensor:
    """max of ``a`` per scale group, shaped to broadcast against ``[..., K]``; an empty group's max is 0 (an
    all-zero group), so an empty tensor quantizes to an empty result under every scale mode."""
    if scale == "row":
        return a.amax(dim=-1, keepdim=True)  # K > 0 (check_last_dim)
    if scale == "expert" and a.ndim < 2:
        raise ValueError("scale='expert' needs a tensor with a leading expert dimension, e.g. [E, N, K].")
    if scale not in ("tensor", "expert"):
        raise ValueError(f"Unknown scale mode {scale!r}: use 'row', 'tensor' or 'expert'.")
    flat = a.reshape(1, -1) if scale == "tensor" else a.flatten(1)
    m = flat.amax(dim=1) if flat.shape[1] else flat.new_zeros(flat.shape[0])
    return m.reshape([-1] + [1] * (a.ndim - 1))


def _group_amax(x: torch.Tensor, scale: str) -> torch.Tensor:
    """amax of |x| per scale group, shaped to broadcast against ``[..., K]``; NaN if the group is not finite."""
    amax = _group_max(x.abs(), scale)
    # amax ignores NaN on some paths and not others: make any non-finite group explicitly NaN.
    bad = _group_max((~torch.isfinite(x)).to(torch.float32), scale)
    return torch.where(bad > 0, torch.full_like(amax, float("nan")), amax)


def _nvfp4_global_scale(x: torch.Tensor, scale: str) -> torch.Tensor:
    amax = _group_amax(x.float(), scale)
    # A tensor divisor: CUDA torch divides by a Python scalar through its rounded reciprocal, not IEEE division.
    return amax / torch.full_like(amax, E2M1_MAX * E4M3_MAX)


def _encode_with_scales(xb: torch.Tensor, sg: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 codes of blocks ``xb`` [..., nb, bs] over fp32 block factors ``sg`` [..., nb, 1]."""
    y = torch.clamp(xb / sg, -E2M1_MAX, E2M1_MAX)
    idx = e2m1_index(y.abs())
    sign = torch.signbit(xb).to(torch.uint8) << 3
    return torch.where(ok, idx, torch.zeros_like(idx)) | sign


def _quantize_nvfp4(x: torch.Tensor, scale: str) -> FP4Tensor:
    bs = 16
    x = x.float()
    g = _nvfp4_global_scale(x, scale)  # broadcast vs [..., K]
    xb = x.unflatten(-1, (-1, bs))
    g_b = g.unsqueeze(-1)  # broadcast vs [..., nb, bs]
    amax_b = xb.abs().amax(dim=-1, keepdim=True)
    s_bytes = e4m3_encode((amax_b / torch.full_like(amax_b, E2M1_MAX)) / g_b)  # g == 0 gives NaN; fixed below
    zero_group = g_b == 0
    s_bytes = torch.where(zero_group, torch.zeros_like(s_bytes), s_bytes)
    s_bytes = torch.where(torch.isnan(g_b), torch.full_like(s_bytes, E4M3_NAN_BYTE), s_bytes)
    sg = e4m3_decode(s_bytes) * g_b
    ok = torch.isfinite(sg) & (sg > 0)
    codes = _encode_with_scales(xb, sg, ok).flatten(-2)
    return FP4Tensor(pack_codes(codes), s_bytes.squeeze(-1), g.contiguous(), "nvfp4")


def _e8m0_exponent(amax_b: torch.Tensor) -> torch.Tensor:
    """floor(log2(amax)) - 2 clamped to [-127, 127], from the fp32 bits (subnormals clamp to -127)."""
    biased = (amax_b.view(torch.int32) >> 23) & 0xFF
    return (biased - 127 - 2).clamp(-127, 127)


def _quantize_mxfp4(x: torch.Tensor) -> FP4Tensor:
    bs = 32
    x = x.float()
    xb = x.unflatten(-1, (-1, bs))
    amax_b = xb.abs().amax(dim=-1, keepdim=True)
    bad = (~torch.isfinite(xb)).any(dim=-1, keepdim=True)
    e = _e8m0_exponent(torch.where(bad, torch.zeros_like(amax_b), amax_b))
    e = torch.where(amax_b == 0, torch.full_like(e, -127), e)
    s_bytes = torch.where(bad, torch.full_like(e, E8M0_NAN_BYTE), e + 127).to(torch.uint8)
    s = pow2(e)
    codes = _encode_with_scales(xb, s, ~bad).flatten(-2)
    g = torch.ones(x.shape[:-1] + (1,), dtype=torch.float32, device=x.device)
    return FP4Tensor(pack_codes(codes), s_bytes.squeeze(-1), g, "mxfp4")


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    if backend == "auto":
        return x.is_cuda
    raise ValueError(f"Unknown backend {backend!r}: use 'auto', 'torch' or 'triton'.")


def quantize(x: torch.Tensor, fmt: str = "nvfp4", scale: str = "row", backend: str = "auto") -> FP4Tensor:
    """Quantize ``x`` (any leading shape, last dimension a multiple of the block) to FP4 with nearest rounding.

    Args:
        x: the tensor, any float dtype.
        fmt: ``"nvfp4"`` or ``"mxfp4"``.
        scale: where the NVFP4 global scale is taken: ``"row"`` (each row of the last dimension, used for
            activations and K/V), ``"expert"`` (each slice of dim 0, used for expert weights) or ``"tensor"``.
            MXFP4 has only per-block scales, so every mode gives it the same result; the mode is still checked,
            so that a call is valid for both formats or for neither.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
    """
    f = check_input(x, fmt)
    check_scale(x, scale)
    if _use_triton(x, backend):
        from trace_hf.kernels.fp4_quant import quantize as triton_quantize

        return triton_quantize(x, fmt=f.name, scale=scale)
    if f.name == "nvfp4":
        return _quantize_nvfp4(x, scale)
    return _quantize_mxfp4(x)


def quantize_with_hints(
    x: torch.Tensor, fmt: str = "nvfp4", scale: str = "row", backend: str = "auto"
) -> tuple[FP4Tensor, FP4Hints]:
    """`quantize` and the `extract_hints` of its result, for recording: the Triton kernel writes the mantissa bits in
    the same pass (the same bits), instead of unpacking the codes again."""
    f = check_input(x, fmt)
    check_scale(x, scale)
    if _use_triton(x, backend):
        from trace_hf.kernels.fp4_quant import quantize as triton_quantize

        return triton_quantize(x, fmt=f.name, scale=scale, return_hints=True)
    q = quantize(x, fmt, scale, backend)
    return q, extract_hints(q)


def dequantize(q: FP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.dequantize(dtype)


def extract_hints(q: FP4Tensor) -> FP4Hints:
    """The hints of a rollout's quantized activation: mantissa bits, block-scale bytes, global scale."""
    return FP4Hints(pack_bits(q.codes() & 1), q.block_scale, q.global_scale, q.fmt)


def guided_quantize(x: torch.Tensor, hints: FP4Hints, backend: str = "auto") -> FP4Tensor:
    """Quantize ``x`` with the rollout's scales, keeping of each value's two FP4 neighbours the one whose
    mantissa bit the rollout recorded (a value on the grid stays). Training then rounds as the rollout did
    wherever the two activations fall between the same pair of grid points."""
    f = check_hints(x, hints)
    if _use_triton(x, backend):
        from trace_hf.kernels.fp4_quant import guided_quantize as triton_guided_quantize

        return triton_guided_quantize(x, hints)
    bs = f.block_size
    xb = x.float().unflatten(-1, (-1, bs))
    # A non-finite training value poisons its block (NaN scale byte), as in `quantize`.
    bad = ~torch.isfinite(xb).all(dim=-1)
    nan_byte = E4M3_NAN_BYTE if f.has_global_scale else E8M0_NAN_BYTE
    block_scale = torch.where(bad, torch.full_like(hints.block_scale, nan_byte), hints.block_scale)
    sg = (block_scale_decode(block_scale, f.name) * hints.global_scale).unsqueeze(-1)
    ok = torch.isfinite(sg) & (sg > 0)
    y = torch.clamp(xb / sg, -E2M1_MAX, E2M1_MAX)
    a = y.abs()
    lo = e2m1_floor_index(a)
    on_grid = _e2m1_signed_table(x.device)[lo.long()] == a
    bit = unpack_bits(hints.mantissa_bits).unflatten(-1, (-1, bs))
    idx = torch.where(on_grid | ((lo & 1) == bit), lo, lo + 1)
    sign = torch.signbit(xb).to(torch.uint8) << 3
    codes = (torch.where(ok, idx, torch.zeros_like(idx)) | sign).flatten(-2)
    return FP4Tensor(pack_codes(codes), block_scale, hints.global_scale, f.name)


def _check_hinted(x: torch.Tensor, hints: FP4Hints, has: torch.Tensor) -> FP4Format:
    f = check_hints(x, hints)
    if has.shape != x.shape[:-1] or has.dtype != torch.bool or has.device != x.device:
        raise ValueError(
            f"hinted_quantize: has must be a bool flag per row of x, shape {tuple(x.shape[:-1])} on {x.device}; got "
            f"{tuple(has.shape)} {has.dtype} on {has.device}."
        )
    return f


def hinted_quantize(
    x: torch.Tensor, hints: FP4Hints, has: torch.Tensor, apply: bool = True, backend: str = "auto"
) -> tuple[FP4Tensor, torch.Tensor]:
    """Training's quantization at a hinted site: each row of ``x`` (``has``: one flag per row, ``x.shape[:-1]``) is
    `guided_quantize`'s where ``has`` is set and `quantize`'s (nearest, row scale) elsewhere, whole rows, so it
    dequantizes to one or the other. ``apply=False`` keeps every row nearest (the "no hints" baseline).

    Also returns the flips (int64, on ``x``'s device, no host sync): the values of the ``has`` rows whose nearest
    code differs from the guided one, +-0 agreeing; counted whether or not they are applied. The Triton kernel does
    all of it in one pass; the reference below is the definition."""
    _check_hinted(x, hints, has)
    if _use_triton(x, backend):
        from trace_hf.kernels.fp4_hinted import hinted_quantize as triton_hinted_quantize

        return triton_hinted_quantize(x, hints, has, apply)
    return compose_hinted(x, hints, has, apply, backend)


def compose_hinted(x: torch.Tensor, hints: FP4Hints, has: torch.Tensor, apply: bool, backend: str):
    """`hinted_quantize` composed of `quantize` and `guided_quantize` (each on ``backend``): its definition, and
    the Triton path for rows too wide for the one-pass kernel."""
    f = get_format(hints.fmt)
    near = quantize(x, f.name, "row", backend)
    guided = guided_quantize(x, hints, backend)
    cn, cg = near.codes(), guided.codes()
    m = has.unsqueeze(-1)
    flips = ((cn != cg) & (((cn | cg) & 7) != 0) & m).sum()
    if not apply:
        return near, flips
    fields = ("packed", "block_scale", "global_scale")
    return FP4Tensor(*(torch.where(m, getattr(guided, k), getattr(near, k)) for k in fields), f.name), flips


def hinted_fake_quantize(
    x: torch.Tensor, hints: FP4Hints, has: torch.Tensor, apply: bool = True, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hinted_quantize` dequantized to ``x.dtype`` (no codes written), and its flips. No autograd: wrap the values
    in `straight_through`."""
    if _use_triton(x, backend):
        from trace_hf.kernels.fp4_hinted import hinted_fake_quantize as triton_hinted_fake_quantize

        _check_hinted(x, hints, has)
        return triton_hinted_fake_quantize(x, hints, has, apply)
    q, flips = hinted_quantize(x, hints, has, apply, backend)
    return q.dequantize(x.dtype), flips


def e2m1_floor_index(a: torch.Tensor) -> torch.Tensor:
    """Index of the largest E2M1 magnitude ``<= a`` for ``0 <= a <= 6``."""
    idx = (a >= 0.5).to(torch.uint8)
    for t in E2M1_VALUES[2:]:
        idx += a >= t
    return idx


# ----------------------------------------------------------------------------------------------------------
# Fake quantization for training (straight-through estimator)
# ----------------------------------------------------------------------------------------------------------


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt, scale, hints, backend):
        if _use_triton(x, backend):
            from trace_hf.kernels.fp4_quant import fake_quantize as triton_fake_quantize

            return triton_fake_quantize(x, fmt, scale, hints)
        q = quantize(x, fmt, scale, backend) if hints is None else guided_quantize(x, hints, backend)
        return q.dequantize(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` in the forward, the gradient of the identity on ``x`` in the backward (for quantized ``y``)."""
    return _StraightThrough.apply(x, y.detach())


def fake_format(fmt: str | None, hints: FP4Hints | None) -> str:
    """The format of a fake quantization: the hints' (an explicit ``fmt`` must agree), else ``fmt`` or NVFP4."""
    if hints is None:
        return "nvfp4" if fmt is None else fmt
    if fmt is not None and get_format(fmt).name != get_format(hints.fmt).name:
        raise ValueError(
            f"fake_quantize(fmt={fmt!r}) got hints recorded in {hints.fmt!r}: hints fix the format; pass "
            f"fmt={hints.fmt!r} (or leave fmt out), or hints recorded in {fmt!r}."
        )
    return hints.fmt


def fake_quantize(
    x: torch.Tensor,
    fmt: str | None = None,
    scale: str = "row",
    hints: FP4Hints | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Quantize and dequantize ``x`` in its own dtype; the backward is a straight-through estimator.

    With ``hints`` the rounding follows the rollout (`guided_quantize`) in the hints' format, otherwise it is
    nearest (`quantize`) in ``fmt`` (default NVFP4).
    """
    fmt = fake_format(fmt, hints)
    return _FakeQuantize.apply(x, fmt, scale, hints, backend)
