"""GPT-2, nanoGPT-equivalent and readable top to bottom.

Architecture: token + learned position embeddings, ``n_layer`` pre-LayerNorm blocks (causal
multi-head self-attention, then a 4x GELU MLP, each in a residual branch), a final LayerNorm and
a language-model head tied to the token embedding. Module names follow nanoGPT (and so, up to
the Conv1D transpose, Hugging Face GPT-2), so parameter names are::

    transformer.wte.weight                   (vocab_size, n_embd)   tied with lm_head.weight
    transformer.wpe.weight                   (block_size, n_embd)
    transformer.h.{i}.ln_1.weight / .bias    (n_embd,)
    transformer.h.{i}.attn.c_attn.weight     (3*n_embd, n_embd)     rows [0:C]=Q, [C:2C]=K, [2C:3C]=V
                                             (3, n_embd, n_embd) with split_qkv: [W_Q, W_K, W_V]
    transformer.h.{i}.attn.c_proj.weight     (n_embd, n_embd)
    transformer.h.{i}.ln_2.weight / .bias    (n_embd,)
    transformer.h.{i}.mlp.c_fc.weight        (4*n_embd, n_embd)
    transformer.h.{i}.mlp.c_proj.weight      (n_embd, 4*n_embd)
    transformer.ln_f.weight / .bias          (n_embd,)

(plus a ``.bias`` for every Linear when ``bias=True``). Weights are ``torch.nn.Linear`` layout
``(out, in)``. With ``split_qkv=True`` the fused projection stores Q, K and V as a batch of
three square matrices (`SplitQKV`): the same function, but an optimizer that constrains a
parameter per matrix of its batch then constrains $W_Q$, $W_K$ and $W_V$ one by one.
``model.named_parameters()`` lists the tied matrix once, as
``transformer.wte.weight``; ``state_dict()`` has both keys.

Diagnostics: `GPT.attention_probe` reruns the model with explicit attention and returns
every layer's attention logits and probabilities (see there).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Model shape. Defaults are GPT-2 small (124M)."""

    block_size: int = 1024
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    split_qkv: bool = False  # store c_attn as three (n_embd, n_embd) matrices W_Q, W_K, W_V (`SplitQKV`)

    def __post_init__(self):
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)


MODEL_CONFIGS: dict[str, GPTConfig] = {
    # GPT-2 small: 124,439,808 parameters (tied head). For a GPU.
    "gpt2": GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
    # ~7.2M parameters, 6.4M of them the (tied) embedding: trains on a 2-core CPU in minutes.
    "mini": GPTConfig(block_size=128, vocab_size=50257, n_layer=4, n_head=4, n_embd=128),
    # ~3.3M parameters, almost all embedding: for tests and smoke runs.
    "tiny": GPTConfig(block_size=64, vocab_size=50257, n_layer=2, n_head=2, n_embd=64),
}


def model_config(name: str, **overrides) -> GPTConfig:
    """A copy of ``MODEL_CONFIGS[name]`` with fields overridden: ``model_config("mini", dropout=0.1)``."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model config {name!r}; valid choices: {', '.join(MODEL_CONFIGS)}")
    valid = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(valid))}")
    return replace(MODEL_CONFIGS[name], **overrides)


def count_parameters(config: GPTConfig, non_embedding: bool = True) -> int:
    """Number of parameters of ``GPT(config)``, computed from the shapes (no model is built).

    Same convention as `GPT.num_parameters`.
    """
    C, V, T, L, b = config.n_embd, config.vocab_size, config.block_size, config.n_layer, int(config.bias)
    ln = C * (1 + b)
    block = 2 * ln + (3 * C * C + 3 * C * b) + (C * C + C * b) + (4 * C * C + 4 * C * b) + (4 * C * C + C * b)
    total = V * C + T * C + L * block + ln
    return total - T * C if non_embedding else total


class SplitQKV(nn.Module):
    r"""The QKV projection with its weight stored as the batch $[W_Q, W_K, W_V]$, shape ``(3, C, C)``.

    ``forward`` is ``nn.Linear`` with the fused weight ``weight.reshape(3C, C)`` (rows ``[0:C]`` =
    $W_Q$, as in the fused layout), so outputs, checkpoints' values and pretrained weights carry
    over by a reshape (`match_qkv_layout`); what changes is that Manifold Muon sees three matrices.
    """

    def __init__(self, n_embd: int, bias: bool):
        super().__init__()
        fused = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # as the fused layout: same RNG use, same init
        self.weight = nn.Parameter(fused.weight.detach().reshape(3, n_embd, n_embd).clone())
        self.bias = fused.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.reshape(-1, self.weight.shape[-1]), self.bias)


def match_qkv_layout(state_dict: dict, config: GPTConfig) -> dict:
    """``state_dict`` with every ``attn.c_attn.weight`` reshaped to ``config``'s layout: fused
    ``(3C, C)`` or, with ``split_qkv``, ``(3, C, C)``."""
    C = config.n_embd
    shape = (3, C, C) if config.split_qkv else (3 * C, C)
    return {k: (v.reshape(shape) if k.endswith("attn.c_attn.weight") else v) for k, v in state_dict.items()}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection (``c_attn``; `SplitQKV` with
    ``split_qkv``)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        if config.split_qkv:
            self.c_attn = SplitQKV(config.n_embd, config.bias)
        else:
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, probe: list | None = None) -> torch.Tensor:
        B, T, C = x.shape
        H = self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, H, T, C/H)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        if probe is None:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        else:
            # Explicit attention, for diagnostics: same result as the fused kernel.
            logits = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            logits = logits.masked_fill(~causal, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            probe.append((logits, probs))
            y = self.attn_dropout(probs) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, probe: list | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), probe)
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class AttentionProbe:
    """Result of `GPT.attention_probe`.

    ``logits[l]`` and ``probs[l]`` are layer ``l``'s (B, H, T, T) attention logits (after the
    1/sqrt(head_dim) scaling, before softmax; entries above the diagonal, i.e. future keys, are
    ``-inf``) and softmax probabilities (masked entries exactly 0); ``output`` is the
    (B, T, vocab) model logits. With ``on_layer`` given, ``logits`` and ``probs`` are empty and
    ``stats[l]`` is what ``on_layer(l, logits, probs)`` returned.
    """

    logits: list[torch.Tensor]
    probs: list[torch.Tensor]
    output: torch.Tensor
    stats: list


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nanoGPT/GPT-2 init: N(0, 0.02) for Linear and Embedding weights, zero biases, and
        N(0, 0.02/sqrt(2*n_layer)) for the residual projections (``c_proj``); LayerNorm 1/0."""
        for module in self.modules():
            if isinstance(module, nn.Linear | SplitQKV):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Parameter count (the tied embedding/head matrix counted once).

        As in nanoGPT, ``non_embedding=True`` subtracts only the position embeddings: the token
        embedding doubles as the output layer, so it stays in the count.
        """
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def _hidden(self, idx: torch.Tensor, probe: list | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, probe)
        return self.transformer.ln_f(x)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx`` (B, T) token ids -> ``(logits (B, T, vocab), loss)``.

        ``loss`` is the mean cross-entropy against ``targets`` (B, T) (entries of -1 ignored), or
        ``None`` without targets. Unlike nanoGPT, logits are returned for every position even
        without targets.
        """
        logits = self.lm_head(self._hidden(idx))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def attention_probe(
        self, idx: torch.Tensor, on_layer: Callable[[int, torch.Tensor, torch.Tensor], object] | None = None
    ) -> AttentionProbe:
        """Run the model with explicit attention and capture every layer's attention.

        Returns an `AttentionProbe` with per-layer ``logits`` (B, H, T, T), scaled
        pre-softmax scores with ``-inf`` at masked (future) positions, and ``probs`` (B, H, T, T),
        plus the model ``output`` logits (equal to ``forward`` up to float rounding). Runs under
        ``torch.no_grad()`` in the model's current mode (call ``model.eval()`` to avoid dropout).

        Memory is ``2 * n_layer * B * H * T * T`` floats (1.2 GB for GPT-2 small at B=1, T=1024);
        pass ``on_layer(layer_index, logits, probs) -> stats`` to reduce each layer on the fly:
        then ``stats`` holds what it returned per layer and ``logits``/``probs`` stay empty.
        """
        captured = [] if on_layer is None else _ReducingList(on_layer)
        output = self.lm_head(self._hidden(idx, probe=captured))
        if on_layer is not None:
            return AttentionProbe(logits=[], probs=[], output=output, stats=captured.results)
        return AttentionProbe(logits=[c[0] for c in captured], probs=[c[1] for c in captured], output=output, stats=[])

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T); returns (B, T + max_new_tokens).

        The context is cropped to the last ``block_size`` tokens. ``temperature=0`` is greedy;
        ``top_k`` keeps only the k most likely tokens; ``generator`` makes sampling reproducible.
        Uses the model's current mode (call ``model.eval()`` first to disable dropout).
        """
        for _ in range(max_new_tokens):
            context = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size :]
            logits, _ = self(context)
            logits = logits[:, -1, :]
            if temperature <= 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx


class _ReducingList:
    """Stands in for the probe list: reduces each layer's (logits, probs) as it arrives."""

    def __init__(self, fn):
        self.fn, self.results = fn, []

    def append(self, item) -> None:
        logits, probs = item
        self.results.append(self.fn(len(self.results), logits, probs))


# --------------------------------------------------------------------------------------------
# Hugging Face GPT-2 weights
# --------------------------------------------------------------------------------------------

_HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def from_hf_gpt2_state_dict(sd: dict, n_head: int | None = None, config: GPTConfig | None = None) -> GPT:
    """Build a `GPT` from a Hugging Face ``GPT2LMHeadModel`` (or ``GPT2Model``) state dict.

    HF stores these four matrices as Conv1D weights of shape (in, out); they are transposed to
    the Linear (out, in) layout. The shape is read off the tensors; ``n_head`` cannot be, so give
    it (or a full ``config``). The attention-mask buffers (``attn.bias``, ``attn.masked_bias``)
    are skipped.
    """
    sd = {(k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not re.search(r"\.attn\.(masked_)?bias$", k)}
    if config is None:
        if n_head is None:
            raise ValueError("give n_head (or config): it cannot be inferred from the weights")
        vocab_size, n_embd = sd["transformer.wte.weight"].shape
        n_layer = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"transformer\.h\.(\d+)\.", k)))
        config = GPTConfig(
            block_size=sd["transformer.wpe.weight"].shape[0],
            vocab_size=vocab_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            bias="transformer.h.0.attn.c_attn.bias" in sd,
        )
    converted = {k: (v.t() if k.endswith(_HF_TRANSPOSED) else v) for k, v in sd.items()}
    converted.setdefault("lm_head.weight", converted["transformer.wte.weight"])
    converted = match_qkv_layout(converted, config)
    model = GPT(config)
    ours = model.state_dict()
    missing = sorted(set(ours) - set(converted))
    unexpected = sorted(set(converted) - set(ours))
    if missing or unexpected:
        raise ValueError(f"state dict does not match GPT-2: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for k, v in converted.items():
            if ours[k].shape != v.shape:
                raise ValueError(f"{k}: shape {tuple(v.shape)} does not match {tuple(ours[k].shape)}")
            ours[k].copy_(v)
    return model


def load_hf_gpt2_folder(path: str | Path, block_size: int | None = None) -> GPT:
    """A `GPT` from a local Hugging Face GPT-2 folder (``config.json`` plus ``model.safetensors``
    or ``pytorch_model.bin``, as ``save_pretrained`` writes them); nothing is downloaded.

    ``block_size`` smaller than the folder's ``n_positions`` crops the position embedding (the
    first ``block_size`` rows), as nanoGPT does."""
    import json

    path = Path(path)
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a Hugging Face model folder (config.json: {exc})") from None
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{path} holds a {hf.get('model_type')!r} model; only gpt2 folders load")
    if (path / "model.safetensors").exists():
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ValueError(
                f"{path}/model.safetensors needs the safetensors package: pip install safetensors"
            ) from None
        sd = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").exists():
        sd = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path} has neither model.safetensors nor pytorch_model.bin")
    n_positions = int(hf.get("n_positions", hf.get("n_ctx", 1024)))
    config = GPTConfig(
        block_size=n_positions,
        vocab_size=int(hf["vocab_size"]),
        n_layer=int(hf["n_layer"]),
        n_head=int(hf["n_head"]),
        n_embd=int(hf["n_embd"]),
    )
    model = from_hf_gpt2_state_dict(sd, config=config)
    if block_size is not None and block_size != n_positions:
        if block_size > n_positions:
            raise ValueError(f"block_size {block_size} exceeds the pretrained n_positions {n_positions}")
        model.config.block_size = block_size
        model.transformer.wpe.weight = nn.Parameter(model.transformer.wpe.weight[:block_size].detach().clone())
    return model


__all__ = [
    "load_hf_gpt2_folder",
    "MODEL_CONFIGS",
    "AttentionProbe",
    "Block",
    "CausalSelfAttention",
    "GPT",
    "GPTConfig",
    "MLP",
    "count_parameters",
    "from_hf_gpt2_state_dict",
    "model_config",
]
