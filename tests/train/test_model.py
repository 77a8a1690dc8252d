"""GPT-2 model: names and shapes, tying, parameter counts, init loss, causality, the attention
probe, generation, configs and the Hugging Face weight loader."""

from __future__ import annotations

import math

import pytest
import torch

from geomtrain.model import (
    GPT,
    MODEL_CONFIGS,
    GPTConfig,
    count_parameters,
    from_hf_gpt2_state_dict,
    match_qkv_layout,
    model_config,
)


def small_config(**kw) -> GPTConfig:
    base = dict(block_size=16, vocab_size=97, n_layer=2, n_head=4, n_embd=32)
    base.update(kw)
    return GPTConfig(**base)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return GPT(model_config("tiny")).eval()


def test_parameter_names_and_shapes():
    cfg = small_config()
    C, V, T = cfg.n_embd, cfg.vocab_size, cfg.block_size
    shapes = {name: tuple(p.shape) for name, p in GPT(cfg).named_parameters()}
    expected = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C)}
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}"
        expected.update(
            {
                f"{h}.ln_1.weight": (C,), f"{h}.ln_1.bias": (C,),
                f"{h}.attn.c_attn.weight": (3 * C, C), f"{h}.attn.c_attn.bias": (3 * C,),
                f"{h}.attn.c_proj.weight": (C, C), f"{h}.attn.c_proj.bias": (C,),
                f"{h}.ln_2.weight": (C,), f"{h}.ln_2.bias": (C,),
                f"{h}.mlp.c_fc.weight": (4 * C, C), f"{h}.mlp.c_fc.bias": (4 * C,),
                f"{h}.mlp.c_proj.weight": (C, 4 * C), f"{h}.mlp.c_proj.bias": (C,),
            }
        )  # fmt: skip
    expected.update({"transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,)})
    assert shapes == expected
    no_bias = {n for n, _ in GPT(small_config(bias=False)).named_parameters()}
    assert not any(n.endswith(".bias") for n in no_bias)


def test_qkv_row_blocks():
    """Rows [0:C] of c_attn produce Q, [C:2C] K, [2C:3C] V: zeroing the V rows zeroes the
    attention output whatever Q and K are."""
    torch.manual_seed(0)
    model = GPT(small_config()).eval()
    attn = model.transformer.h[0].attn
    C = model.config.n_embd
    with torch.no_grad():
        attn.c_attn.weight[2 * C :].zero_()
        attn.c_attn.bias[2 * C :].zero_()
        attn.c_proj.bias.zero_()
    y = attn(torch.randn(2, 5, C))
    assert torch.count_nonzero(y) == 0


def test_tied_embedding():
    model = GPT(small_config())
    assert model.lm_head.weight is model.transformer.wte.weight
    sd = model.state_dict()
    assert "lm_head.weight" in sd and torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names


def test_init_statistics():
    torch.manual_seed(0)
    cfg = small_config(n_embd=64, n_layer=4, vocab_size=4000)
    model = GPT(cfg)
    h = model.transformer.h[0]
    assert abs(h.attn.c_attn.weight.std().item() - 0.02) < 0.002
    assert abs(h.mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.001
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.001
    assert torch.count_nonzero(h.mlp.c_fc.bias) == 0
    assert torch.all(h.ln_1.weight == 1)


def test_gpt2_parameter_count():
    cfg = model_config("gpt2")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size) == (12, 12, 768, 1024, 50257)
    assert count_parameters(cfg, non_embedding=False) == 124_439_808
    assert count_parameters(cfg) == 124_439_808 - 1024 * 768
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_parameters(non_embedding=False) == 124_439_808
    assert model.num_parameters() == count_parameters(cfg)


@pytest.mark.parametrize("bias", [True, False])
def test_count_parameters_matches_model(bias):
    for name in ("tiny", "mini"):
        cfg = model_config(name, bias=bias)
        with torch.device("meta"):
            model = GPT(cfg)
        for ne in (True, False):
            assert model.num_parameters(non_embedding=ne) == count_parameters(cfg, non_embedding=ne)


def test_init_loss_is_about_log_vocab(tiny):
    g = torch.Generator().manual_seed(0)
    V, T = tiny.config.vocab_size, tiny.config.block_size
    idx = torch.randint(0, V, (4, T), generator=g)
    targets = torch.randint(0, V, (4, T), generator=g)
    logits, loss = tiny(idx, targets)
    assert logits.shape == (4, T, V)
    assert abs(loss.item() - math.log(V)) < 0.1
    assert tiny(idx)[1] is None
    # ignore_index=-1
    masked = targets.clone()
    masked[:, ::2] = -1
    assert torch.isfinite(tiny(idx, masked)[1])


def test_loss_backward_and_dropout_train_mode():
    torch.manual_seed(0)
    model = GPT(small_config(dropout=0.1)).train()
    idx = torch.randint(0, 97, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_causal(tiny):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, tiny.config.vocab_size, (2, 20), generator=g)
    changed = idx.clone()
    changed[:, 12:] = torch.randint(0, tiny.config.vocab_size, (2, 8), generator=g)
    with torch.no_grad():
        a, _ = tiny(idx)
        b, _ = tiny(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_sequence_longer_than_block_is_rejected():
    model = GPT(small_config())
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_attention_probe_matches_sdpa(tiny):
    g = torch.Generator().manual_seed(2)
    B, T = 2, 24
    idx = torch.randint(0, tiny.config.vocab_size, (B, T), generator=g)
    with torch.no_grad():
        logits, _ = tiny(idx)
    probe = tiny.attention_probe(idx)
    torch.testing.assert_close(probe.output, logits, rtol=0, atol=1e-5)
    H = tiny.config.n_head
    assert len(probe.logits) == len(probe.probs) == tiny.config.n_layer
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    for att_logits, probs in zip(probe.logits, probe.probs, strict=True):
        assert att_logits.shape == probs.shape == (B, H, T, T)
        assert torch.isneginf(att_logits[..., future]).all()
        assert torch.isfinite(att_logits[..., ~future]).all()
        assert torch.all(probs[..., future] == 0)
        torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, T))
        torch.testing.assert_close(probs, torch.softmax(att_logits, -1))

    # Layer-0 logits recomputed by hand from c_attn: pins the Q/K row blocks and the scaling.
    C = tiny.config.n_embd
    block = tiny.transformer.h[0]
    with torch.no_grad():
        pos = torch.arange(T)
        x = block.ln_1(tiny.transformer.wte(idx) + tiny.transformer.wpe(pos))
        q = (x @ block.attn.c_attn.weight[:C].T + block.attn.c_attn.bias[:C]).view(B, T, H, C // H).transpose(1, 2)
        k = (
            (x @ block.attn.c_attn.weight[C : 2 * C].T + block.attn.c_attn.bias[C : 2 * C])
            .view(B, T, H, C // H)
            .transpose(1, 2)
        )
        manual = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
    torch.testing.assert_close(probe.logits[0][..., ~future], manual[..., ~future], rtol=1e-5, atol=1e-5)

    # on_layer reduces each layer as it comes.
    reduced = tiny.attention_probe(idx, on_layer=lambda i, lg, p: (i, p.amax(-1).mean().item()))
    assert reduced.logits == [] and reduced.probs == []
    assert [s[0] for s in reduced.stats] == list(range(tiny.config.n_layer))
    torch.testing.assert_close(reduced.output, logits, rtol=0, atol=1e-5)


def test_generate(tiny):
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    a = tiny.generate(idx, 5, generator=torch.Generator().manual_seed(0))
    b = tiny.generate(idx, 5, generator=torch.Generator().manual_seed(0))
    assert a.shape == (2, 8) and torch.equal(a, b) and torch.equal(a[:, :3], idx)
    assert a.dtype == torch.long and int(a.max()) < tiny.config.vocab_size
    greedy = tiny.generate(idx, 3, temperature=0)
    with torch.no_grad():
        first = tiny(idx)[0][:, -1].argmax(-1)
    assert torch.equal(greedy[:, 3], first)
    top1 = tiny.generate(idx, 3, top_k=1, generator=torch.Generator().manual_seed(5))
    assert torch.equal(top1, greedy)
    # context longer than block_size is cropped, not rejected
    long = torch.zeros(1, tiny.config.block_size + 3, dtype=torch.long)
    assert tiny.generate(long, 2, top_k=10).shape == (1, tiny.config.block_size + 5)


def test_model_configs():
    assert set(MODEL_CONFIGS) >= {"gpt2", "mini", "tiny"}
    for name in MODEL_CONFIGS:
        assert model_config(name).vocab_size == 50257
    cfg = model_config("mini", vocab_size=1000, dropout=0.1)
    assert (cfg.vocab_size, cfg.dropout, cfg.n_layer) == (1000, 0.1, MODEL_CONFIGS["mini"].n_layer)
    assert MODEL_CONFIGS["mini"].vocab_size == 50257  # overrides copy
    with pytest.raises(ValueError, match="gpt2, mini, tiny"):
        model_config("gpt3")
    with pytest.raises(ValueError, match="n_embed"):
        model_config("tiny", n_embed=3)
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=100, n_head=3)


def _to_hf_layout(model: GPT) -> dict:
    """Our state dict in Hugging Face GPT-2 layout (Conv1D weights transposed, mask buffers)."""
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    sd = {k: (v.t().contiguous() if k.endswith(conv1d) else v.clone()) for k, v in model.state_dict().items()}
    T = model.config.block_size
    for i in range(model.config.n_layer):
        sd[f"transformer.h.{i}.attn.bias"] = torch.ones(T, T).tril().view(1, 1, T, T)
    return sd


def test_load_hf_layout_state_dict():
    torch.manual_seed(0)
    ref = GPT(small_config()).eval()
    loaded = from_hf_gpt2_state_dict(_to_hf_layout(ref), n_head=4).eval()
    assert loaded.config == ref.config
    idx = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx)[0], ref(idx)[0], rtol=0, atol=0)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    with pytest.raises(ValueError, match="n_head"):
        from_hf_gpt2_state_dict(_to_hf_layout(ref))


def test_load_real_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(
        vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    ours = from_hf_gpt2_state_dict(hf.state_dict(), n_head=4).eval()
    idx = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, rtol=1e-4, atol=1e-4)


def test_split_qkv_is_the_fused_model_stored_as_three_matrices():
    """Same seed, same init (the split weight is the fused one reshaped), same function; the
    state dicts convert both ways with `match_qkv_layout`, also for Hugging Face weights."""
    torch.manual_seed(0)
    fused = GPT(small_config()).eval()
    torch.manual_seed(0)
    split = GPT(small_config(split_qkv=True)).eval()
    W = split.transformer.h[0].attn.c_attn.weight
    assert W.shape == (3, 32, 32) and split.transformer.h[0].attn.c_attn.bias.shape == (96,)
    sd_f, sd_s = fused.state_dict(), split.state_dict()
    assert set(sd_f) == set(sd_s)
    for k in sd_f:
        assert torch.equal(sd_f[k].reshape(sd_s[k].shape), sd_s[k]), k
    assert torch.equal(W[1], fused.transformer.h[0].attn.c_attn.weight[32:64])  # W_K is rows [C:2C]
    idx = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert torch.equal(fused(idx)[0], split(idx)[0])
    back = GPT(small_config()).eval()
    back.load_state_dict(match_qkv_layout(sd_s, back.config))
    assert all(torch.equal(back.state_dict()[k], sd_f[k]) for k in sd_f)
    from_hf = from_hf_gpt2_state_dict(_to_hf_layout(fused), config=small_config(split_qkv=True)).eval()
    with torch.no_grad():
        assert torch.equal(from_hf(idx)[0], fused(idx)[0])
    assert fused.num_parameters() == split.num_parameters() == count_parameters(split.config)
