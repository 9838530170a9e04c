"""Straightforward float64 implementations of Kimi K3's decode math, written from the
equations (per token, per head, per expert loops) and sharing no code with
``rewriter.model.layers``: the oracle the reference layers are tested against.

Every function takes the layer's parameters by their vLLM names (a state dict) and
returns float64 tensors; state tensors passed in are updated in place.
"""
from __future__ import annotations

import math

import torch

D = torch.float64


def _f(t: torch.Tensor) -> torch.Tensor:
    return t.to(D)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = _f(x)
    return x / torch.sqrt((x * x).mean() + eps) * _f(w)


def sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return beta * torch.tanh(gate / beta) * sigmoid(gate) * linear_beta * torch.tanh(up / linear_beta)


def attn_res(prefix, delta, blocks, norm_w, qk_w, out_w, num_blocks, write_idx, eps):
    """Returns (out, new_prefix, new_blocks) for every token, one source at a time."""
    prefix, blocks = _f(prefix).clone(), _f(blocks).clone()
    out = torch.empty_like(prefix)
    for t in range(prefix.shape[0]):
        if delta is not None:
            prefix[t] = prefix[t] + _f(delta[t])
        if write_idx >= 0:
            blocks[t, write_idx] = prefix[t]
        sources = [blocks[t, i] for i in range(num_blocks)] + [prefix[t]]
        logits = []
        for s in sources:
            rms = math.sqrt(float((s * s).mean()) + eps)
            logits.append(float((s * _f(norm_w) * _f(qk_w)).sum()) / rms)
        m = max(logits)
        weights = [math.exp(v - m) for v in logits]
        total = sum(weights)
        mix = sum(w / total * s for w, s in zip(weights, sources))
        out[t] = rmsnorm(mix, out_w, eps)
    return out, prefix, blocks


def kda(p: dict, x, conv_state, rec_state, state_indices, *, heads, head_dim, conv_size, lower_bound, eps=1e-5):
    """KDA attention incl. o_proj (before all-reduce). ``p`` keys are relative to self_attn."""
    T = x.shape[0]
    B = state_indices.shape[0]
    q_len = T // B
    P = heads * head_dim
    w_in, w_fb, w_o = _f(p["in_proj_qkvgfab.weight"]), _f(p["f_b_proj.weight"]), _f(p["o_proj.weight"])
    conv_w = _f(p["conv1d.weight"])[:, 0, :]  # [3P, K]
    out = torch.zeros(T, w_o.shape[0], dtype=D)
    for t in range(T):
        slot = int(state_indices[t // q_len])
        proj = w_in @ _f(x[t])
        mixed, g_out = proj[: 3 * P], proj[3 * P: 4 * P]
        f_a = proj[4 * P: 4 * P + head_dim]
        beta = proj[4 * P + head_dim: 4 * P + head_dim + heads]
        g1 = w_fb @ f_a
        conv_out = torch.empty(3 * P, dtype=D)
        for c in range(3 * P):
            hist = _f(conv_state[slot, c])  # K-1 previous inputs, oldest first
            acc = sum(conv_w[c, i] * hist[i] for i in range(conv_size - 1)) + conv_w[c, conv_size - 1] * mixed[c]
            conv_out[c] = acc * sigmoid(acc)
            conv_state[slot, c] = torch.cat([hist[1:], mixed[c: c + 1]]).to(conv_state.dtype)
        o_all = torch.empty(P, dtype=D)
        for h in range(heads):
            sl = slice(h * head_dim, (h + 1) * head_dim)
            q = conv_out[sl]
            k = conv_out[P + h * head_dim: P + (h + 1) * head_dim]
            v = conv_out[2 * P + h * head_dim: 2 * P + (h + 1) * head_dim]
            q = q / torch.sqrt((q * q).sum() + 1e-6) / math.sqrt(head_dim)
            k = k / torch.sqrt((k * k).sum() + 1e-6)
            a = math.exp(float(p["A_log"][h]))
            raw = g1[sl] + _f(p["dt_bias"])[sl]
            if lower_bound is not None:
                gate = lower_bound * sigmoid(a * raw)
            else:
                gate = -a * torch.log1p(torch.exp(raw))
            b = sigmoid(beta[h])
            S = _f(rec_state[slot, h])  # [V, K]
            S = S * torch.exp(gate)[None, :]
            S = S + b * torch.outer(v - S @ k, k)
            rec_state[slot, h] = S.to(rec_state.dtype)
            o = S @ q
            o = o / torch.sqrt((o * o).mean() + eps) * _f(p["o_norm.weight"]) * sigmoid(g_out[sl])
            o_all[sl] = o
        out[t] = w_o @ o_all
    return out


def mla(p: dict, x, cache_tokens: list[torch.Tensor], *, heads, q_lora, kv_lora, nope, rope, v_dim, eps):
    """MLA without absorption: keys and values materialized per head from the latent.

    ``cache_tokens[b]`` is request b's latent entries [S_b, kv_lora + rope] BEFORE this
    step; this step's tokens (request-major, q_len each) are appended causally.
    """
    T = x.shape[0]
    B = len(cache_tokens)
    q_len = T // B
    scale = (nope + rope) ** -0.5
    w_a, w_qb, w_kvb, w_o = (_f(p[k]) for k in ("fused_qkv_a_g_proj.weight", "q_b_proj.weight",
                                                   "kv_b_proj.weight", "o_proj.weight"))
    new_entries, queries, gates = [], [], []
    for t in range(T):
        proj = w_a @ _f(x[t])
        q_c, kv_c = proj[:q_lora], proj[q_lora: q_lora + kv_lora]
        k_pe = proj[q_lora + kv_lora: q_lora + kv_lora + rope]
        gates.append(proj[q_lora + kv_lora + rope:])
        q_c = rmsnorm(q_c, p["q_a_layernorm.weight"], eps)
        kv_c = rmsnorm(kv_c, p["kv_a_layernorm.weight"], eps)
        new_entries.append(torch.cat([kv_c, k_pe]))
        queries.append((w_qb @ q_c).view(heads, nope + rope))
    out = torch.zeros(T, w_o.shape[0], dtype=D)
    w_kvb = w_kvb.view(heads, nope + v_dim, kv_lora)
    for t in range(T):
        b, j = divmod(t, q_len)
        entries = torch.cat([_f(cache_tokens[b]), torch.stack(new_entries[b * q_len: b * q_len + j + 1])])
        o = torch.empty(heads * v_dim, dtype=D)
        for h in range(heads):
            k_nope = entries[:, :kv_lora] @ w_kvb[h, :nope].T  # [S, nope]
            values = entries[:, :kv_lora] @ w_kvb[h, nope:].T  # [S, v]
            k = torch.cat([k_nope, entries[:, kv_lora:]], dim=1)
            scores = (k @ queries[t][h]) * scale
            attn = torch.softmax(scores, dim=0)
            o[h * v_dim: (h + 1) * v_dim] = attn @ values
        out[t] = w_o @ (o * sigmoid(gates[t]))
    return out


def moe(p: dict, x, *, top_k, scaling, renormalize, beta, linear_beta, eps):
    """Latent MoE on one rank before its all-reduce, then the tail (TP 1 semantics)."""
    T = x.shape[0]
    w13, w2 = _f(p["experts.routed_experts.w13_weight"]), _f(p["experts.routed_experts.w2_weight"])
    inter = w2.shape[2]
    out = torch.zeros(T, p["routed_expert_up_proj.weight"].shape[0], dtype=D)
    for t in range(T):
        xt = _f(x[t])
        scores = sigmoid(_f(p["gate.weight"]) @ xt)
        choice = scores + _f(p["gate.e_score_correction_bias"])
        picked = sorted(range(len(choice)), key=lambda e: -float(choice[e]))[:top_k]
        weights = torch.stack([scores[e] for e in picked])
        if renormalize:
            weights = weights / weights.sum()
        weights = weights * scaling
        latent_in = _f(p["routed_expert_down_proj.weight"]) @ xt
        latent = torch.zeros_like(latent_in)
        for w, e in zip(weights, picked):
            h = w13[e] @ latent_in
            latent += w * (w2[e] @ situ(h[:inter], h[inter:], beta, linear_beta))
        gu = _f(p["shared_experts.gate_up_proj.weight"]) @ xt
        half = gu.shape[0] // 2
        shared = _f(p["shared_experts.down_proj.weight"]) @ situ(gu[:half], gu[half:], beta, linear_beta)
        latent = rmsnorm(latent, p["routed_expert_norm.weight"], eps)
        out[t] = _f(p["routed_expert_up_proj.weight"]) @ latent + shared
    return out


def dense_mlp(p: dict, x, *, beta, linear_beta):
    gu = _f(x) @ _f(p["gate_up_proj.weight"]).T
    half = gu.shape[1] // 2
    return situ(gu[:, :half], gu[:, half:], beta, linear_beta) @ _f(p["down_proj.weight"]).T


def sub(params: dict, prefix: str) -> dict:
    """The entries of a state dict under ``prefix.``, with the prefix removed."""
    return {k[len(prefix) + 1:]: v for k, v in params.items() if k.startswith(prefix + ".")}


def decoder_layer(params: dict, cfg, layer_idx: int, hidden, prefix, blocks, attention):
    """A whole layer: AttnRes wiring as vLLM's KimiDecoderLayer, around ``attention(x)`` and the MLP."""
    block = cfg.attn_res_block_size
    eps = cfg.rms_norm_eps
    writes = layer_idx % block == 0
    prev = -(-layer_idx // block)
    x, prefix, blocks = attn_res(prefix, hidden if layer_idx > 0 else None, blocks,
                                 params["self_attention_res_norm.weight"], params["self_attention_res_proj.weight"][0],
                                 params["input_layernorm.weight"], prev, layer_idx // block if writes else -1, eps)
    a = attention(x)
    if writes:
        prefix, delta = a, None
    else:
        delta = a
    x, prefix, blocks = attn_res(prefix, delta, blocks, params["mlp_res_norm.weight"],
                                 params["mlp_res_proj.weight"][0], params["post_attention_layernorm.weight"],
                                 prev + int(writes), -1, eps)
    if cfg.is_moe_layer(layer_idx):
        out = moe(sub(params, "block_sparse_moe"), x, top_k=cfg.num_experts_per_token,
                  scaling=cfg.routed_scaling_factor, renormalize=cfg.moe_renormalize,
                  beta=cfg.activation_situ_beta, linear_beta=cfg.activation_situ_linear_beta, eps=eps)
    else:
        out = dense_mlp(sub(params, "mlp"), x, beta=cfg.activation_situ_beta,
                        linear_beta=cfg.activation_situ_linear_beta)
    return out, prefix, blocks
