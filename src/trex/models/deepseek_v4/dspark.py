"""DeepSeek-V4.1's DSpark drafter (the checkpoint's ``mtp.*`` stages): drafts a block of tokens per step.

What DeepSeek's official V4.1 ``inference/model.py`` defines (``DSparkBlock``, ``DSparkAttention``,
``DSparkMarkovHead``, ``DSparkConfidenceHead``, ``Transformer.forward_spec``), in trex's pieces: it is a
decode-time module, so this file is one too. After the main model's step at position p has produced its
token t and the target layers' hidden h [B, k d] (each the mean over the mHC streams of that layer's
input, Engram added), the drafter

1. projects h to main_x = main_norm(main_proj(h)) [B, d] (stage 0 only);
2. runs a block of ``dspark_block_size`` tokens (t, then the noise token), at positions p + 1 ... p + T,
   through its stages: V4.1 blocks (single-pass mHC) whose attention is window-only and whose window
   holds every stage's own K = V of the main model's positions (wkv of main_x): a draft query sees the
   window's last min(W, p + 1) positions and the whole block (no causal mask), with the sink;
3. ends with the main model's head on the last stage's collapsed, normed output, plus a rank-r Markov
   bias from each draft position's previous token (sampled left to right), and a confidence per position
   from ``proj(cat(x, markov_embed))`` (x before the norm).

The prefill over the prompt only seeds the windows with the prompt's main_x. The embedding and head
are the main model's (the official stages hold references to them); the drafter owns neither, and a
post-trained backbone drafts through its own. The stages are loaded frozen
(``trex.checkpoint.load.load_drafter``); a recipe's ``[drafter]`` re-fits them (trex.train.drafter_refit)
through ``DSparkDrafter.forward``, the training form: every anchor of a sequence drafts its block at once,
teacher-forced, and each draft equals what :meth:`DSparkDrafter.draft` computes at that step
(tests/test_drafter_refit.py). ``tests/test_model_v41.py`` checks the drafts, logits and confidences against
the official code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trex.kernels import quantize
from trex.kernels.sparse_attention import scores_fp32
from trex.models.common.heads import init_parameters
from trex.models.common.linear import QuantLinear, QuantSim, linear_fp32, spread_quant
from trex.models.common.norm import RMSNorm
from trex.models.common.rope import apply_rope, rope_inv_freq
from trex.models.deepseek_v4.attention import add_projections, grouped_output
from trex.models.deepseek_v4.attention_v41 import Shared
from trex.models.deepseek_v4.config_v41 import V41Config
from trex.models.deepseek_v4.decode import decode_attention
from trex.models.deepseek_v4.mhc import HyperConnection
from trex.models.deepseek_v4.model_v41 import Block


@dataclass
class DraftContext:
    """What a drafting forward hands its stages (the part of ``SeqContext`` a block reads, plus the drafter's
    own): input_ids [B, T] the block's ids (the router reads them); cos, sin [B, T, rd/2] the block's RoPE;
    main_cos, main_sin [B, 1, rd/2] the RoPE of the main position p; main_x [B, 1, d]; valid [B, W] the
    window slots a query sees; cache the windows, or None while prefilling."""

    input_ids: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    main_x: torch.Tensor
    main_cos: torch.Tensor
    main_sin: torch.Tensor
    valid: torch.Tensor | None
    cache: "DraftCache"
    recording: bool = False  # MoE statistics: drafting records none
    token_mask: torch.Tensor | None = None
    routes: dict | None = None  # no routing replay or recording while drafting
    route_log: dict | None = None


@dataclass
class FitContext:
    """What the fitting forward hands its stages: A anchors' blocks of T at once, flattened to A T tokens.
    input_ids [B, A T]; cos, sin [B, A T, rd/2] the blocks' RoPE; main_x [B, N, d] every main position's,
    at main_cos, main_sin [B, N, rd/2]; window [A, W] the sequence index of each anchor's window slot
    (its main position and the W - 1 before it); valid [B, A, W] the slots a query sees."""

    input_ids: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    main_x: torch.Tensor
    main_cos: torch.Tensor
    main_sin: torch.Tensor
    window: torch.Tensor
    valid: torch.Tensor
    recording: bool = False
    token_mask: torch.Tensor | None = None
    routes: dict | None = None
    route_log: dict | None = None


class DraftCache:
    """Each stage's window: [B, W, c] RoPE'd K = V of the main model's last W positions, newest last; ``pos``
    [B] the main position the next step drafts from."""

    def __init__(self):
        self.windows: dict[nn.Module, torch.Tensor] = {}
        self.pos: torch.Tensor | None = None


class DSparkAttention(nn.Module):
    """Window attention of a DSpark stage: the V4 projections; keys are the stage's window of main-model
    positions and the block's own tokens."""

    profile_scope = "attention/dspark"  # trex.profile.scopes

    def __init__(self, cfg: V41Config):
        super().__init__()
        add_projections(self, cfg)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        return quantize.fake_fp8_act(kv, 32) if self.wkv.quant.kv else kv

    def seed(self, main_x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: DraftCache) -> None:
        """The prefill: main_x [B, S, d] at RoPE cos, sin [B, S, rd/2] -> the window's last W entries."""
        W = self.cfg.sliding_window
        cache.windows[self] = F.pad(self._kv(main_x, cos, sin)[:, -W:], (0, 0, max(0, W - main_x.shape[1]), 0))

    def forward(self, x: torch.Tensor, ctx: DraftContext | FitContext, shared: Shared) -> tuple[torch.Tensor, Shared]:
        """x: [B, T, d] the block (attn_norm'ed) -> ([B, T, d], shared unchanged). Pushes the main position's
        entry into the window first. With a FitContext, x is [B, A T, d]: A anchors' blocks (the training ``forward``)."""
        if isinstance(ctx, FitContext):
            return self._fit(x, ctx), shared
        B, T, _ = x.shape
        H, c = self.n_heads, self.head_dim
        window = torch.cat([ctx.cache.windows[self][:, 1:], self._kv(ctx.main_x, ctx.main_cos, ctx.main_sin)], dim=1)
        ctx.cache.windows[self] = window
        q = apply_rope(self.wq_b(self.q_norm(self.wq_a(x))).view(B, T, H, c), ctx.cos[:, :, None], ctx.sin[:, :, None])
        block = self._kv(x, ctx.cos, ctx.sin)
        # the T queries as T x H heads of one query: each sees the valid window and the whole block
        o = decode_attention(q.reshape(B, 1, T * H, c), window, ctx.valid, self.attn_sink.repeat(T),
                             self.head_dim**-0.5, block, torch.ones(B, 1, T, dtype=torch.bool, device=x.device))
        return grouped_output(self, o.view(B, T, H, c), ctx.cos, ctx.sin), shared

    def _fit(self, x: torch.Tensor, ctx: FitContext) -> torch.Tensor:
        """``forward`` at A anchors at once: x [B, A T, d] -> [B, A T, d]. Each anchor's T queries see its own
        window slots and its own block, one softmax with the sink, as ``decode_attention`` computes it."""
        B, AT, _ = x.shape
        A, W = ctx.window.shape
        T, H, c = AT // A, self.n_heads, self.head_dim
        q = apply_rope(self.wq_b(self.q_norm(self.wq_a(x))).view(B, AT, H, c), ctx.cos[:, :, None], ctx.sin[:, :, None])
        block = self._kv(x, ctx.cos, ctx.sin).view(B, A, T, c)
        window = self._kv(ctx.main_x, ctx.main_cos, ctx.main_sin)[:, ctx.window]  # [B, A, W, c]
        keys = torch.cat([window, block], dim=2)
        mask = torch.cat([ctx.valid, ctx.valid.new_ones(B, A, T)], dim=2)
        logits = scores_fp32(q.view(B, A, T * H, c), keys.transpose(2, 3)) * self.head_dim**-0.5  # [B, A, T H, W + T]
        logits = logits.masked_fill(~mask[:, :, None], float("-inf"))
        sink = self.attn_sink.repeat(T).float().view(1, 1, T * H, 1).expand(B, A, T * H, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1].to(q.dtype)
        return grouped_output(self, (probs @ keys).view(B, AT, H, c), ctx.cos, ctx.sin)


class DSparkStage(Block):
    """One ``mtp.N`` stage: a V4.1 block (mHC, MoE with the drafter's expert count, no Engram) whose
    attention is :class:`DSparkAttention`; stage 0 also has ``main_proj``/``main_norm``, the last stage
    ``norm``, ``markov_head`` (``embed`` [V, r], ``head`` [V, r]) and ``confidence_head.proj`` [1, d + r]."""

    def __init__(self, cfg: V41Config, stage: int):
        layer = cfg.num_hidden_layers + stage
        moe = dataclasses.replace(cfg, n_routed_experts=cfg.dspark_n_routed_experts,
                                  num_experts_per_tok=cfg.dspark_num_experts_per_tok, engram_layer_ids=[],
                                  engram_num_embeddings=[])
        super().__init__(moe, layer, f"mtp.{stage}", attn=DSparkAttention(cfg))
        d = cfg.hidden_size
        if stage == 0:
            self.main_proj = QuantLinear(d * len(cfg.dspark_target_layer_ids), d, block=cfg.fp8_block)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if stage == cfg.num_nextn_predict_layers - 1:
            r = cfg.dspark_markov_rank
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(cfg.vocab_size, r)
            self.markov_head.head = nn.Linear(r, cfg.vocab_size, bias=False)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(d + r, 1, bias=False)


@dataclass
class Draft:
    """One drafting step: ids [B, T + 1] (the main model's token, then the T drafted), logits [B, T, V] fp32
    (position i's, Markov bias added; they sample ids[:, i + 1]), confidence [B, T] fp32."""

    ids: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor


class DSparkDrafter(nn.Module):
    """The DSpark stages of a V4.1 config, named as the checkpoint's ``mtp.N.*``."""

    def __init__(self, cfg: V41Config):
        super().__init__()
        if not cfg.num_nextn_predict_layers or not cfg.dspark_target_layer_ids:
            raise ValueError("this config has no DSpark drafter (num_nextn_predict_layers or dspark_target_layer_ids "
                             "is empty)")
        self.cfg = cfg
        self.mtp = nn.ModuleList(DSparkStage(cfg, i) for i in range(cfg.num_nextn_predict_layers))
        self.quant = QuantSim()
        init_parameters(self, cfg.initializer_range, None)
        self.requires_grad_(False)  # loaded frozen; a re-fit (trex.train.drafter_refit) turns its gradients on
        self.eval()

    @property
    def target_layers(self) -> list[int]:
        """The main model's layers whose (stream-mean) input the drafter reads."""
        return list(self.cfg.dspark_target_layer_ids)

    def set_quant(self, quant: QuantSim) -> None:
        """The served rounding points (``QuantSim.kv``: window K = V through FP8; the linears' as the model's)."""
        spread_quant(self, quant, (QuantLinear,))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of window-only layers (rope_theta, no YaRN) at positions [...] -> cos, sin [..., rd/2]."""
        inv_freq = rope_inv_freq(self.cfg.qk_rope_head_dim, self.cfg.rope_theta, None).to(positions.device)
        angles = positions[..., None].float() * inv_freq
        return angles.cos(), angles.sin()

    def _main_x(self, hidden: torch.Tensor) -> torch.Tensor:
        first = self.mtp[0]
        return first.main_norm(first.main_proj(hidden))

    @torch.no_grad()
    def prefill(self, hidden: torch.Tensor, positions: torch.Tensor) -> DraftCache:
        """The prompt's target hidden [B, S, k d] at its positions [B, S] (an entry left of a row's document
        is never seen) -> a cache whose next step drafts from position positions[:, -1] + 1."""
        cache = DraftCache()
        main_x = self._main_x(hidden)
        cos, sin = self._rope(positions)
        for stage in self.mtp:
            stage.attn.seed(main_x, cos, sin, cache)
        cache.pos = positions[:, -1] + 1
        return cache

    @torch.no_grad()
    def draft(self, cache: DraftCache, token: torch.Tensor, hidden: torch.Tensor, embed: torch.Tensor,
              head: torch.Tensor, sample=None) -> Draft:
        """One step at main position p = cache.pos: the main model's token [B] there and its target hidden
        [B, k d]; ``embed`` and ``head`` [V, d] are the main model's weights, whole (under tensor parallelism
        the caller gathers them: trex.rollout.speculation.draft_steps). ``sample`` maps logits [B, V] to ids [B]
        (default: greedy). The windows then hold position p."""
        cfg, B = self.cfg, token.shape[0]
        T, W = cfg.dspark_block_size, cfg.sliding_window
        pos = cache.pos
        ids = token.new_full((B, T), cfg.dspark_noise_token_id)
        ids[:, 0] = token
        cos, sin = self._rope(pos[:, None] + 1 + torch.arange(T, device=token.device))
        main_cos, main_sin = self._rope(pos[:, None])
        valid = torch.arange(W, device=token.device) >= W - 1 - pos[:, None]  # the last min(W, p + 1) positions
        ctx = DraftContext(ids, cos, sin, self._main_x(hidden[:, None]), main_cos, main_sin, valid, cache)
        X = F.embedding(ids, embed).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(*X.shape[:3], device=X.device)
        pre[..., 0] = 1.0
        for stage in self.mtp:
            X, pre, _ = stage(X, pre, Shared(), ctx, None)
        cache.pos = pos + 1
        last = self.mtp[-1]
        x = HyperConnection.collapse(X, pre)
        logits = linear_fp32(last.norm(x), head)
        sample = sample or (lambda z: z.argmax(dim=-1))
        out = torch.empty(B, T + 1, dtype=token.dtype, device=token.device)
        out[:, 0] = token
        markov = []
        for i in range(T):  # each position's bias depends on the token sampled before it
            e = last.markov_head.embed(out[:, i])
            logits[:, i] += linear_fp32(e, last.markov_head.head.weight)
            markov.append(e)
            out[:, i + 1] = sample(logits[:, i])
        confidence = linear_fp32(torch.cat([x, torch.stack(markov, dim=1)], dim=-1), last.confidence_head.proj.weight)
        return Draft(out, logits, confidence.squeeze(-1))

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, start: int, anchors: int,
                embed: torch.Tensor, head: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The training form of ``draft`` (the module's forward, so FSDP2 gathers the stages around it): the
        drafts of ``anchors`` consecutive main positions at once, teacher-forced, each a block of ``block``
        (default: the config's ``dspark_block_size``; the stages do not depend on it). ids [B, N] a sequence (left padding at positions [B, N] < 0), hidden [B, N', k d] its target
        hidden (as ``prefill`` takes it; N' >= start + anchors: the positions no anchor reads may be left off); anchor a is sequence index j = start + a (the main position whose
        hidden the step reads): its block is ids[:, j + 1] then the noise token, and draft position i's Markov
        bias comes from ids[:, j + 1 + i] (the token a verified draft puts before it), so j + T + 1 < N. embed,
        head [V, d]: the main model's weights, detached (the drafter's objective never reaches the backbone).
        -> (logits [B, A, T, V] fp32: position i's predicts ids[:, j + 2 + i]; confidence [B, A, T] fp32
        logits), each what ``draft`` computes at that step given those tokens."""
        cfg = self.cfg
        T, W = block or cfg.dspark_block_size, cfg.sliding_window
        B, N = ids.shape
        if start < 0 or start + anchors + T >= N:
            raise ValueError(f"anchors {start} .. {start + anchors - 1} need ids up to {start + anchors + T}; "
                             f"the sequence has {N}")
        device = ids.device
        anchor = start + torch.arange(anchors, device=device)  # [A] sequence indices
        after = anchor[:, None] + 1 + torch.arange(T, device=device)  # [A, T]: ids[after] precede each position
        block = ids.new_full((B, anchors, T), cfg.dspark_noise_token_id)
        block[:, :, 0] = ids[:, anchor + 1]
        cos, sin = self._rope((positions[:, anchor, None] + 1 + torch.arange(T, device=device)).flatten(1))
        main_cos, main_sin = self._rope(positions[:, :hidden.shape[1]])
        window = anchor[:, None] - W + 1 + torch.arange(W, device=device)  # [A, W], newest last
        valid = (window >= 0) & (positions[:, window.clamp(min=0)] >= 0)
        flat = block.flatten(1)
        ctx = FitContext(flat, cos, sin, self._main_x(hidden), main_cos, main_sin, window.clamp(min=0), valid)
        X = F.embedding(flat, embed.detach()).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(*X.shape[:3], device=X.device)
        pre[..., 0] = 1.0
        for stage in self.mtp:
            X, pre, _ = stage(X, pre, Shared(), ctx, None)
        last = self.mtp[-1]
        x = HyperConnection.collapse(X, pre)
        markov = last.markov_head.embed(ids[:, after].flatten(1))
        logits = linear_fp32(last.norm(x), head.detach()) + linear_fp32(markov, last.markov_head.head.weight)
        confidence = linear_fp32(torch.cat([x, markov], dim=-1), last.confidence_head.proj.weight)
        return logits.view(B, anchors, T, -1), confidence.view(B, anchors, T)
