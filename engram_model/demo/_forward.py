"""The Engram layer's arithmetic in float32 NumPy: projections, context-aware gate, short convolution.

Follows ``Engram.forward`` and ``ShortConv`` of DeepSeek's ``engram_demo_v1.py``; RMSNorm has
``torch.nn.RMSNorm`` semantics (``x / sqrt(mean(x^2) + eps) * weight``). Weights live in
:class:`EngramWeights`, whose ``state_dict`` uses the reference module's parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: The gate norms are ``nn.RMSNorm(hidden)`` without eps, i.e. the float32 machine epsilon.
GATE_NORM_EPS = float(np.finfo(np.float32).eps)
#: ``ShortConv(norm_eps=1e-5)``.
CONV_NORM_EPS = 1e-5
#: The gate score's magnitude is clamped here before its square root, so the slope stays finite at 0.
GATE_CLAMP = 1e-6
#: Standard deviation of the initial projection and convolution weights (biases start at 0, norms at 1).
INIT_STD = 0.02


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Normalise the last axis to unit root-mean-square, then scale by ``weight``."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(ms + np.float32(eps))).astype(x.dtype) * weight


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for very negative x gives the right limit, 0
        return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


@dataclass
class EngramWeights:
    """Parameters of one Engram layer, stored stacked over the ``hc`` channels.

    ``hc`` = hc_mult, ``C`` = hidden_size, ``E`` = engram hidden size (heads x D_head), ``K`` = kernel_size.
    """

    key_w: np.ndarray      # (hc, C, E)   key_projs.{i}.weight
    key_b: np.ndarray      # (hc, C)      key_projs.{i}.bias
    value_w: np.ndarray    # (C, E)       value_proj.weight
    value_b: np.ndarray    # (C,)         value_proj.bias
    norm1: np.ndarray      # (hc, C)      norm1.{i}.weight  (keys)
    norm2: np.ndarray      # (hc, C)      norm2.{i}.weight  (queries)
    conv_w: np.ndarray     # (hc*C, 1, K) short_conv.conv.weight
    conv_norm: np.ndarray  # (hc, C)      short_conv.norms.{i}.weight

    @classmethod
    def initial(cls, hc: int, hidden: int, engram_hidden: int, kernel_size: int,
                rng: np.random.Generator) -> "EngramWeights":
        """Seeded start: N(0, INIT_STD) projection and conv weights, zero biases, unit norm weights."""
        def normal(*shape: int) -> np.ndarray:
            return rng.normal(0.0, INIT_STD, size=shape).astype(np.float32)

        return cls(
            key_w=normal(hc, hidden, engram_hidden), key_b=np.zeros((hc, hidden), np.float32),
            value_w=normal(hidden, engram_hidden), value_b=np.zeros(hidden, np.float32),
            norm1=np.ones((hc, hidden), np.float32), norm2=np.ones((hc, hidden), np.float32),
            conv_w=normal(hc * hidden, 1, kernel_size), conv_norm=np.ones((hc, hidden), np.float32),
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every state-dict name and the shape it must have."""
        hc, C, E = self.key_w.shape
        shapes: dict[str, tuple[int, ...]] = {}
        for i in range(hc):
            shapes[f"key_projs.{i}.weight"] = (C, E)
            shapes[f"key_projs.{i}.bias"] = (C,)
        shapes["value_proj.weight"] = (C, E)
        shapes["value_proj.bias"] = (C,)
        for i in range(hc):
            shapes[f"norm1.{i}.weight"] = (C,)
        for i in range(hc):
            shapes[f"norm2.{i}.weight"] = (C,)
        shapes["short_conv.conv.weight"] = tuple(self.conv_w.shape)
        for i in range(hc):
            shapes[f"short_conv.norms.{i}.weight"] = (C,)
        return shapes

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the parameters under the reference's names."""
        hc = self.key_w.shape[0]
        out: dict[str, np.ndarray] = {}
        for i in range(hc):
            out[f"key_projs.{i}.weight"] = self.key_w[i].copy()
            out[f"key_projs.{i}.bias"] = self.key_b[i].copy()
        out["value_proj.weight"] = self.value_w.copy()
        out["value_proj.bias"] = self.value_b.copy()
        for i in range(hc):
            out[f"norm1.{i}.weight"] = self.norm1[i].copy()
        for i in range(hc):
            out[f"norm2.{i}.weight"] = self.norm2[i].copy()
        out["short_conv.conv.weight"] = self.conv_w.copy()
        for i in range(hc):
            out[f"short_conv.norms.{i}.weight"] = self.conv_norm[i].copy()
        return out

    def assign(self, state: dict[str, np.ndarray]) -> None:
        """Copy already-checked float32 arrays (names and shapes as in :meth:`expected_shapes`) in."""
        for name, value in state.items():
            parts = name.split(".")
            if parts[0] == "key_projs":
                (self.key_w if parts[2] == "weight" else self.key_b)[int(parts[1])] = value
            elif name == "value_proj.weight":
                self.value_w[...] = value
            elif name == "value_proj.bias":
                self.value_b[...] = value
            elif parts[0] in ("norm1", "norm2"):
                getattr(self, parts[0])[int(parts[1])] = value
            elif name == "short_conv.conv.weight":
                self.conv_w[...] = value
            else:  # short_conv.norms.{i}.weight
                self.conv_norm[int(parts[2])] = value

    def fused_projection(self) -> tuple[np.ndarray, np.ndarray]:
        """Keys of every channel and the value as one matrix: ``(E, (hc+1)*C)`` and its bias ``((hc+1)*C,)``."""
        hc, C, E = self.key_w.shape
        w = np.concatenate([self.key_w.reshape(hc * C, E), self.value_w])  # ((hc+1)*C, E)
        b = np.concatenate([self.key_b.reshape(hc * C), self.value_b])
        return np.ascontiguousarray(w.T), b


def gates_and_value(e: np.ndarray, h: np.ndarray, w: EngramWeights, proj_w: np.ndarray,
                    proj_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Context-aware gate per channel and the projected value.

    ``e``: rows of each position, float32 ``(M, E)`` (M = B*L); ``h``: hidden states ``(M, hc, C)``.
    Returns ``gates (M, hc)`` and ``value (M, C)``.
    """
    M, hc, C = h.shape
    proj = e @ proj_w + proj_b                                         # (M, (hc+1)*C)
    key = proj[:, :hc * C].reshape(M, hc, C)                           # (M, hc, C)
    value = proj[:, hc * C:]                                           # (M, C)
    normed_key = rms_norm(key, w.norm1, GATE_NORM_EPS)
    normed_query = rms_norm(h, w.norm2, GATE_NORM_EPS)
    score = np.einsum("mic,mic->mi", normed_key, normed_query) / np.float32(np.sqrt(C))  # (M, hc)
    score = np.sqrt(np.maximum(np.abs(score), np.float32(GATE_CLAMP))) * np.sign(score)
    return sigmoid(score), value


def short_conv(x: np.ndarray, w: EngramWeights, dilation: int) -> np.ndarray:
    """``ShortConv``: per-channel RMSNorm, causal depthwise dilated conv1d (no bias), SiLU.

    ``x``: float32 ``(B, L, hc, C)`` -> the same shape. Output ``y[t] = sum_j w[:, j] * x[t - (K-1-j)*dilation]``
    with positions before the start reading zero.
    """
    B, L, hc, C = x.shape
    K = w.conv_w.shape[-1]
    xn = rms_norm(x, w.conv_norm, CONV_NORM_EPS).reshape(B, L, hc * C)  # (B, L, hc*C)
    taps = w.conv_w[:, 0, :]                                             # (hc*C, K)
    y = np.zeros_like(xn)
    for j in range(K):
        shift = (K - 1 - j) * dilation
        if shift < L:
            y[:, shift:, :] += xn[:, :L - shift, :] * taps[:, j]
    return silu(y).reshape(B, L, hc, C)


def engram_output(embeddings: np.ndarray, hidden_states: np.ndarray, w: EngramWeights, proj_w: np.ndarray,
                  proj_b: np.ndarray, dilation: int) -> tuple[np.ndarray, np.ndarray]:
    """The Engram branch: ``(output (B, L, hc, C), gates (B, L, hc))`` from rows ``(B, L, H, D_head)``."""
    B, L, hc, C = hidden_states.shape
    e = embeddings.reshape(B * L, -1)                                   # (M, H*D_head)
    gates, value = gates_and_value(e, hidden_states.reshape(B * L, hc, C), w, proj_w, proj_b)
    v = (gates[:, :, None] * value[:, None, :]).reshape(B, L, hc, C)    # (B, L, hc, C)
    return v + short_conv(v, w, dilation), gates.reshape(B, L, hc)
