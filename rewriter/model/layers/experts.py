"""How routed experts' weights are stored: bf16, or MXFP4 in the layout vLLM leaves them.

Kimi K3's routed experts are released as MXFP4 (compressed-tensors ``mxfp4-pack-quantized``):
FP4 E2M1 codes, one E8M0 scale per 32 values along K, value = E2M1(code) * 2^(scale - 127).
The same bytes appear in the layouts below, and which one a served layer holds depends on the
MoE backend vLLM picked; a kernel reading one layout as another would pass every shape check
and be silently wrong, so every part of the project that touches expert weights (reference
layer, random weights, binding to vLLM, cost, kernels) asks one ``ExpertFormat``:

- ``bf16``: dense ``w13`` [E, 2I, L], ``w2`` [E, L, I] (the reference's own, and vLLM's for an
  unquantized checkpoint);
- ``mxfp4/checkpoint``: as vLLM's loader leaves them before its backend re-lays them (and as a
  CPU build of vLLM keeps them): weight uint8 [E, N, K/2], two codes per byte along K, element
  2i in the low nibble; scale uint8 [E, N, K/32];
- ``mxfp4/humming``: what vLLM's Humming backend (the sm_90 default, humming-kernels 0.1.19,
  bf16 activations) leaves after ``process_weights_after_loading``: weight int32 [E, K/16, 2N]
  of 16 (K) x 64 (N) tiles, each one warp's ``mma.m16n8k16`` A fragments (lane ``r * 4 + q``
  holds rows ``r (+8) (+16 i3)``, K ``2q (+1) (+8)`` of the tile in its 4 words, nibble ``p =
  i6 * 4 + i4 * 2 + i5`` of word ``i3``); scale float8_e8m0fnu [E, K/32, N], each 64-row group
  8 x 8 transposed (lane ``r`` finds its 8 rows' scales in 8 consecutive bytes). Codes and
  scale bytes are moved, never changed.
- ``mxfp4/humming_native``: Humming's layout where it dequantizes natively (sm_100 with NVRTC
  13.2 or newer): the same words, nibbles in natural order ``p = i4 * 4 + i5 * 2 + i6``.

``N`` is the output rows (2I for ``w13``, L for ``w2``), ``K`` the input width.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7; bit 3 is the sign
E2M1_RMS = (sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES)) ** 0.5  # of uniform random codes
GROUP = 32  # values per E8M0 scale along K
LAYOUTS = {"bf16": ("dense",), "mxfp4": ("checkpoint", "humming", "humming_native")}
HUMMING_TILE_N, HUMMING_TILE_K = 64, 16
DEQUANT_CHUNK = 8  # matrices dequantized at a time: each pass's temporaries stay near 1 GB
RELAYOUT_CHUNK = 32  # experts re-laid at a time by ``from_checkpoint``: each int64 temporary stays under 1 GB
MAX_KERNEL_SCALE = 128  # E8M0 bytes the kernels' in-register dequant takes: scales up to 2 (codegen/kernels/mxfp4.py)


class ExpertFormatError(ValueError):
    """An expert format that does not exist, or tensors that are not in the format claimed."""


@dataclass(frozen=True)
class ExpertFormat:
    dtype: str  # "bf16" | "mxfp4"
    layout: str  # "dense" for bf16; "checkpoint" | "humming" | "humming_native" for mxfp4

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS.get(self.dtype, ()):
            known = ", ".join(f"{d}/{lay}" for d, lays in LAYOUTS.items() for lay in lays)
            raise ExpertFormatError(f"unknown expert format {self.dtype}/{self.layout}; known: {known}")

    @classmethod
    def parse(cls, name: str | ExpertFormat) -> ExpertFormat:
        """``bf16``, ``mxfp4`` (Humming's layout: what an H200 serves), or ``mxfp4/<layout>``."""
        if isinstance(name, ExpertFormat):
            return name
        dtype, _, layout = str(name).partition("/")
        if dtype not in LAYOUTS:
            raise ExpertFormatError(f"unknown expert dtype {dtype!r}; accepted: bf16, mxfp4, mxfp4/<layout> "
                                    f"with layout one of {', '.join(LAYOUTS['mxfp4'])}")
        return cls(dtype, layout or ("dense" if dtype == "bf16" else "humming"))

    @property
    def name(self) -> str:
        return "bf16" if self.dtype == "bf16" else f"mxfp4/{self.layout}"

    @property
    def quantized(self) -> bool:
        return self.dtype == "mxfp4"

    def tensors(self, experts: int, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of ``weight`` (and ``weight_scale``) holding ``experts`` x [n, k]."""
        if not self.quantized:
            return {"weight": ((experts, n, k), torch.bfloat16)}
        if k % GROUP:
            raise ExpertFormatError(f"MXFP4 needs K a multiple of {GROUP}, got {k}")
        if self.layout == "checkpoint":
            return {"weight": ((experts, n, k // 2), torch.uint8),
                    "weight_scale": ((experts, n, k // GROUP), torch.uint8)}
        if n % HUMMING_TILE_N or k % HUMMING_TILE_K:
            raise ExpertFormatError(f"Humming's layout needs N a multiple of {HUMMING_TILE_N} and K of "
                                    f"{HUMMING_TILE_K}, got N {n}, K {k}")
        return {"weight": ((experts, k // 16, 2 * n), torch.int32),
                "weight_scale": ((experts, k // GROUP, n), torch.float8_e8m0fnu)}

    # ---- values ------------------------------------------------------------------------
    def codes(self, weight: Tensor) -> Tensor:
        """E2M1 codes (uint8) [..., N, K] of MXFP4 weights with any leading dims."""
        if self.layout == "checkpoint":
            return unpack_nibbles(weight)
        return _humming_codes(weight, native=self.layout == "humming_native")

    def scale_bytes(self, scale: Tensor) -> Tensor:
        """E8M0 exponents (uint8) [..., N, K/32]."""
        s = scale.view(torch.uint8)
        if self.layout == "checkpoint":
            return s
        return _humming_scale_to_rows(s)

    def dequant(self, weight: Tensor, scale: Tensor | None, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The weights' values [..., N, K], exact (E2M1 values have two significant bits, so even
        bf16 holds each times its power of two), at 2 bytes a value for the reference's gathers.
        A few matrices at a time: the reference's [tokens, k] gathers of whole matrices made the
        temporaries of one pass several times the output (50 GB at TP 3, 32 tokens)."""
        if not self.quantized:
            return weight
        *lead, a, b = weight.shape
        weight, scale = weight.reshape(-1, a, b), scale.reshape(-1, *scale.shape[-2:])
        out = None
        for lo in range(0, max(weight.shape[0], 1), DEQUANT_CHUNK):  # one pass at least: no rows, no values
            part = self._values(weight[lo:lo + DEQUANT_CHUNK], scale[lo:lo + DEQUANT_CHUNK], dtype)
            if out is None:
                out = part.new_empty((weight.shape[0], *part.shape[1:]))
            out[lo:lo + part.shape[0]] = part
        return out.reshape(*lead, *out.shape[1:])

    def _values(self, weight: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
        codes = self.codes(weight)
        mag, exp = (codes & 1).to(dtype), (codes >> 1 & 3).to(dtype)  # E2M1: m, then e1 e0
        # e = 0: m / 2 (subnormal); e > 0: (1 + m / 2) * 2^(e - 1)
        values = torch.where(exp == 0, mag * 0.5, (1 + mag * 0.5) * torch.exp2(exp - 1))
        values = torch.where(codes >= 8, -values, values)
        powers = torch.exp2(self.scale_bytes(scale).to(torch.float32) - 127.0).to(dtype)
        return values * powers.repeat_interleave(GROUP, dim=-1)

    def from_checkpoint(self, weight: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
        """Checkpoint-layout MXFP4 tensors [E, N, K/2], [E, N, K/32] re-laid in this layout
        (what Humming's repack does, in plain torch)."""
        if not self.quantized:
            raise ExpertFormatError("bf16 experts have no MXFP4 checkpoint layout")
        if self.layout == "checkpoint":
            return weight, scale
        native = self.layout == "humming_native"
        e, n, k2 = weight.shape
        words = torch.empty((e, k2 * 2 // 16, 2 * n), dtype=torch.int32, device=weight.device)
        for lo in range(0, e, RELAYOUT_CHUNK):  # the int64 codes of all 896 experts would be 13 to 20 GB
            words[lo:lo + RELAYOUT_CHUNK] = _humming_words(unpack_nibbles(weight[lo:lo + RELAYOUT_CHUNK]), native)
        return words, _humming_scale_from_rows(scale.view(torch.uint8)).view(torch.float8_e8m0fnu)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """uint8 [..., K/2] -> codes uint8 [..., K], element 2i from the low nibble of byte i."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def pack_nibbles(codes: Tensor) -> Tensor:
    """Codes [..., K] -> uint8 [..., K/2] (the checkpoint packing)."""
    c = codes.to(torch.uint8).unflatten(-1, (-1, 2))  # uint8 throughout: int64 was 18 GiB for 896 experts
    return c[..., 0] | (c[..., 1] << 4)


# Humming's tile: n = nt*64 + i3*16 + i4*8 + r, k = kb*16 + i5*8 + q*2 + i6. Word (kb, nt*128 +
# (r*4 + q)*4 + i3) holds the tile's 8 codes of lane (r, q), subtile i3, in nibble p:
def _nibble_axes(native: bool) -> tuple[str, str, str]:
    """The (i6, i4, i5) axes from the word's most significant nibble axis to the least."""
    return ("i4", "i5", "i6") if native else ("i6", "i4", "i5")


_N_AXES = ("nt", "i3", "i4", "r")
_K_AXES = ("kb", "i5", "q", "i6")


def _humming_words(codes: Tensor, native: bool) -> Tensor:
    """codes [E, N, K] -> int32 [E, K/16, 2N]."""
    codes = codes.to(torch.int64)
    e, n, k = codes.shape
    split = codes.reshape(e, n // 64, 4, 2, 8, k // 16, 2, 4, 2)  # e, nt i3 i4 r, kb i5 q i6
    axes = ("e", *_N_AXES, *_K_AXES)
    order = ("e", "kb", "nt", "r", "q", "i3", *_nibble_axes(native))
    tiles = split.permute(*(axes.index(a) for a in order)).reshape(e, k // 16, 2 * n, 8)
    words = (tiles << (4 * torch.arange(8, device=codes.device))).sum(-1)  # nibble p = 0..7, low first
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of bit 31


def _humming_codes(words: Tensor, native: bool) -> Tensor:
    """int32 [..., K/16, 2N] -> codes uint8 [..., N, K] (any leading dims)."""
    *lead, kb, n2 = words.shape
    n, k = n2 // 2, kb * 16
    nib = torch.stack([(words >> (4 * p) & 0xF).to(torch.uint8) for p in range(8)], dim=-1)  # [..., kb, 2N, p]
    hi, mid, lo = _nibble_axes(native)
    split = nib.reshape(*lead, kb, n // 64, 8, 4, 4, 2, 2, 2)  # kb nt r q i3 | hi mid lo
    have = ("kb", "nt", "r", "q", "i3", hi, mid, lo)
    want = (*_N_AXES, *_K_AXES)
    d = len(lead)
    perm = [*range(d), *(d + have.index(a) for a in want)]
    return split.permute(*perm).reshape(*lead, n, k)


def _humming_scale_from_rows(s: Tensor) -> Tensor:
    """uint8 [E, N, G] -> [E, G, N] with each 64-row group 8 x 8 transposed."""
    e, n, g = s.shape
    return s.transpose(1, 2).reshape(e, g, n // 64, 8, 8).transpose(-1, -2).reshape(e, g, n).contiguous()


def _humming_scale_to_rows(s: Tensor) -> Tensor:
    """uint8 [..., G, N] (Humming) -> [..., N, G]."""
    *lead, g, n = s.shape
    return s.reshape(*lead, g, n // 64, 8, 8).transpose(-1, -2).reshape(*lead, g, n).transpose(-1, -2)


def random_mxfp4(experts: int, n: int, k: int, *, live_rows: int | Tensor | None = None, live_k: int | None = None,
                 generator: torch.Generator | None = None, device: str | torch.device = "cpu",
                 scale_exponent: int = -6) -> tuple[Tensor, Tensor]:
    """Random checkpoint-layout MXFP4 tensors: uniform codes, scale exponents around
    ``scale_exponent`` (+-2, as real weights' are), and zeros (code 0, scale byte 0, as vLLM
    pads) outside ``live_rows`` (a boolean row mask, or the first rows' count) and ``live_k`` columns."""
    g = generator
    codes = torch.randint(0, 16, (experts, n, k), generator=g, device=device, dtype=torch.uint8)
    exps = torch.randint(scale_exponent - 2, scale_exponent + 3, (experts, n, k // GROUP), generator=g, device=device)
    scale = (exps + 127).to(torch.uint8)
    if live_k is not None and live_k < k:
        codes[..., live_k:] = 0
        scale[..., live_k // GROUP:] = 0
    if live_rows is not None:
        dead = ~live_rows if isinstance(live_rows, Tensor) else torch.arange(n, device=device) >= live_rows
        codes[:, dead] = 0
        scale[:, dead] = 0
    return pack_nibbles(codes), scale


def mxfp4_scale_refusal(routed: "torch.nn.Module") -> str | None:
    """Why the kernels cannot dequantize these experts' scales (a scale above 2, i.e. a block
    with values above 12: no trained checkpoint's), or None. Reads the scales once, at build."""
    for name in ("w13_weight_scale", "w2_weight_scale"):
        top = int(getattr(routed, name).view(torch.uint8).max())
        if top > MAX_KERNEL_SCALE:
            return (f"{name} holds an E8M0 scale 2^{top - 127}; the MXFP4 kernels dequantize scales up to "
                    f"2^{MAX_KERNEL_SCALE - 127}")
    return None


def humming_relayout(packed: Tensor, scale: Tensor, n: int, k: int) -> tuple[Tensor, Tensor, object]:
    """What vLLM 0.33's Humming backend does to checkpoint-layout experts [E, n, k/2], [E, n, k/32]
    after loading (``quantization/utils/humming/moe.py``: the MXFP4 schema's conversion, then
    ``prepare_and_transform_humming_tensors`` with vLLM's padding and bf16 activations), done by
    the humming package itself (humming-kernels, a CUDA device): (weight, scale, its LayerConfig).
    The ground truth ``ExpertFormat.from_checkpoint`` is tested against, and the tensors the
    benchmarks give both the kernels and Humming's own MoE."""
    from humming.schema import HummingInputSchema, Mxfp4WeightSchema
    from humming.transform import prepare_and_transform_humming_tensors

    experts = packed.shape[0]
    schema, tensors = Mxfp4WeightSchema().convert_humming(
        tensors={"weight": packed, "weight_scale": scale}, shape_n_stacks=[n], shape_k_stacks=[k],
        param_dtype=torch.bfloat16, num_experts=experts)
    config, out = prepare_and_transform_humming_tensors(
        tensors=tensors, shape_n=n, shape_k=k, pad_n_to_multiple=256, pad_k_to_multiple=128,
        input_schema=HummingInputSchema(), weight_schema=schema, has_bias=False, num_experts=experts,
        torch_dtype=torch.bfloat16, device=packed.device)
    return out["weight"], out["weight_scale"], config
