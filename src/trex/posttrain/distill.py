"""`[train] mode = "distill"`: on-policy distillation from one or more frozen teachers.

One optimizer step:

    take prompts_per_step prompts (each rank an equal share); the student samples
        samples_per_prompt completions of each from its live weights (trex.rollout), each row's draws
        fixed by its place in the step (on_policy.rank_uniforms), so any data-parallel split samples alike
    for each micro-batch: every teacher scores the student's rows (no grad); the student's forward;
        at every sampled position the weighted reverse KL over the full vocabulary
        sum_i w_i KL(student || teacher_i) (trex.posttrain.distill_loss, fp32, chunked), averaged
        over all sampled tokens of the step; backward
    metrics: the reverse KL to each teacher, response length, entropy, trainer-vs-sampler log-prob
        difference on the sampled tokens

With an ``[environment]`` the student samples multi-turn, tool-using trajectories
(trex.posttrain.environment): the teachers score them whole, the KL is taken at the student's tokens.

Teachers are loaded frozen and sharded like the student (trex.posttrain.objective.load_frozen) and
must share its tokenizer. Evaluation samples the held-out prompts with a fixed seed and reports
the student's reverse KL to each teacher there, plus greedy exact match (over all files and per
file) when records have answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from trex.data.loader import Batch
from trex.models import evaluating
from trex.models.common.heads import Model
from trex.recipe import check_choices, require_positive
from trex.posttrain.distill_loss import reverse_kl
from trex.posttrain.environment import MultiTurn
from trex.posttrain.grpo_loss import rollout_correction, token_entropy
from trex.posttrain.objective import (Objective, StepResult, TrainContext, backward_micro_batches, load_frozen,
                                      next_token_logprobs)
from trex.posttrain.rollout_parity import N_MAXIMA, N_SUMS, parity_metrics, parity_sums
from trex.posttrain.on_policy import (PromptOrder, Rollouts, exact_match_by_set, generator_state, load_eval_sets,
                                      load_prompts, make_engine, probe_batch, rank_generator, rank_uniforms,
                                      roll_out, sampling_params, set_generator_state, sync_engine)

EVAL_SEED = 1234  # held-out samples are drawn with the same seed at every evaluation


@dataclass
class TeacherSpec:
    path: str = ""
    """Teacher checkpoint directory (same tokenizer/vocabulary as the student)."""
    weight: float = 1.0
    """w_i in sum_i w_i KL(student || teacher_i)."""

    def __post_init__(self) -> None:
        if not self.path or self.weight < 0:
            raise ValueError(f"distill.teachers: expected {{path = \"...\", weight >= 0}}, got path={self.path!r} "
                             f"weight={self.weight}")


@dataclass
class DistillSection:
    """On-policy distillation (trex.posttrain.distill): the student samples, teachers score its tokens."""
    teachers: list[TeacherSpec] = field(default_factory=list)
    """Teachers: [{ path = "...", weight = 1.0 }, ...]."""
    prompts: list[str] = field(default_factory=list)
    """Prompt files: JSONL records {"prompt": str | "messages": [...], "answer": ... (optional)}."""
    eval_prompts: list[str] = field(default_factory=list)
    """Held-out prompt files: reverse KL to each teacher and, with answers, greedy exact match."""
    eval_limit: int = 0
    """Held-out prompts evaluated (0: all)."""
    prompts_per_step: int = 16
    """Prompts per optimizer step over all ranks."""
    samples_per_prompt: int = 1
    """Completions sampled per prompt."""
    micro_batch_size: int = 32
    """Completions per training forward."""
    chunk: int = 1024
    """Positions per chunk of the full-vocabulary KL (bounds its fp32 memory)."""
    seed: int = 0
    """Seeds the prompt order and the sampler."""
    correction: Literal["auto", "none", "decoupled"] = "auto"
    """Off-policy correction for an engine whose policy is not the student's: decoupled weights each
    completion's positions by min(prod_t pi_student / pi_rollout, is_cap) over its sampled tokens (the KL
    is taken over the full vocabulary at every visited state, so what needs correcting is how likely the
    student was to visit them) | none | auto: none in-process, decoupled with any other engine."""
    is_cap: float = 2.0
    """Truncation of the decoupled weights."""

    def __post_init__(self) -> None:
        check_choices(self, "distill")
        require_positive(self, "distill", ("prompts_per_step", "samples_per_prompt", "micro_batch_size", "chunk",
                                           "is_cap"))


class DistillObjective(Objective):
    def __init__(self, ctx: TrainContext):
        recipe, par = ctx.recipe, ctx.par
        self.ctx, self.cfg, self.sampling = ctx, recipe.distill, recipe.sampling
        self.thinking = recipe.data.thinking
        if self.sampling.asynchronous:
            raise ValueError("sampling.asynchronous = true: on-policy distillation samples each step's batch "
                             "synchronously (asynchronous rollouts are grpo's); expected false")
        if not self.cfg.teachers:
            raise ValueError("distill.teachers is empty; expected [{ path = \"...\", weight = 1.0 }, ...]")
        if not self.cfg.prompts:
            raise ValueError("distill.prompts is empty; expected JSONL files of {\"prompt\" | \"messages\"}")
        self.teachers = [load_frozen(t.path, ctx) for t in self.cfg.teachers]
        self.weights = [t.weight for t in self.cfg.teachers]
        chat_format = recipe.data.chat_format  # the prompts rendered as the student's SFT data is
        self.prompts = load_prompts(self.cfg.prompts, ctx.tokenizer, self.thinking, chat_format=chat_format)
        self.eval_sets = load_eval_sets(self.cfg.eval_prompts, ctx.tokenizer, self.thinking, self.cfg.eval_limit,
                                        par.data_world, "distill", chat_format)
        self.eval_prompts = [p for prompts in self.eval_sets.values() for p in prompts]
        self.order = PromptOrder(len(self.prompts), self.cfg.prompts_per_step, par, self.cfg.seed, "distill")
        self.generator = torch.Generator().manual_seed(self.cfg.seed)  # alike on every rank: rank_uniforms
        self.teacher_exact_match: dict[str, float] | None = None
        self.engine = None  # started at the first step
        self.correction = self.cfg.correction if self.cfg.correction != "auto" else (
            "none" if self.sampling.engine == "in_process" else "decoupled")
        self.multiturn = (MultiTurn(recipe.environment, chat_format, self.thinking, ctx.tokenizer, "distill")
                          if recipe.environment.name else None)

    def _rollouts(self, model: Model, prompts: list, generator: torch.Generator | None,
                  uniforms: torch.Tensor | None = None, engine=None) -> Rollouts:
        ctx = self.ctx
        return roll_out(model, [p.ids for p in prompts], sampling_params(self.sampling, ctx.tokenizer), ctx.tokenizer,
                        generator, self.sampling.batch_size, ctx.dev.torch_device, uniforms, engine)

    def _teacher_logits(self, ids: torch.Tensor, docs: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            return [t(ids, doc_ids=docs).logits[mask] for t in self.teachers]

    def _sums(self, z: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, sampler_logp: torch.Tensor,
              per_teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per micro-batch: ([tokens, entropy, KL to each teacher, trainer-vs-sampler parity] sums,
        the parity maxima)."""
        sampled = ids.roll(-1, dims=1)[mask]  # mask[b, t]: the token at t + 1 was sampled
        logp = torch.log_softmax(z.detach().float(), dim=-1).gather(1, sampled[:, None]).squeeze(1)
        parity, maxima = parity_sums(logp, sampler_logp[mask])
        return torch.cat([torch.stack([mask.sum().float(), token_entropy(z).sum()]).double(),
                          per_teacher.sum(dim=1).double(), parity]), maxima

    def step(self, model: Model, step: int, scaler) -> StepResult:
        ctx, cfg = self.ctx, self.cfg
        device = ctx.dev.torch_device
        chosen = [self.prompts[i] for i in self.order.next() for _ in range(cfg.samples_per_prompt)]
        # a row's draws depend on its place in the step, not on the rank it lands on (as GRPO's)
        rows = cfg.prompts_per_step * cfg.samples_per_prompt
        uniforms = (rank_uniforms(self.generator, rows, self.sampling.max_new_tokens, ctx.par) if self.multiturn is None
                    else self.multiturn.uniforms(self.generator, rows, self.sampling.max_new_tokens, ctx.par))
        if self.engine is None:
            self.engine = make_engine(self.sampling, model, ctx.dev, ctx.policy)
        probe = [p.ids for p in self.prompts[:self.sampling.probe_rows]]
        engine_metrics = sync_engine(self.engine, model, step, probe, self.sampling, ctx.par, step + 1)
        if self.multiturn is None:
            r = self._rollouts(model, chosen, None, uniforms, self.engine)
        else:  # the teachers score the whole trajectories; the KL is taken at the student's sampled tokens only
            params = sampling_params(self.sampling, ctx.tokenizer)
            r, trajs = self.multiturn.roll_out(model, self.engine, chosen, params, uniforms, self.sampling.batch_size,
                                               device)
            engine_metrics.update(self.multiturn.metrics(trajs, ctx.par, device))
        n_tok = int(ctx.par.all_reduce_sum(r.mask.sum().double()).item())
        is_sum = torch.zeros((), dtype=torch.float64, device=device)
        slices = r.micro_batches(cfg.micro_batch_size)
        sums = torch.zeros(2 + len(self.teachers) + N_SUMS, dtype=torch.float64, device=device)
        maxima = torch.zeros(N_MAXIMA, dtype=torch.float64, device=device)
        loss_total = torch.zeros((), dtype=torch.float64, device=device)

        def loss_of(s):
            ids, docs, mask = r.input_ids[s], r.doc_ids[s], r.mask[s]
            teacher_logits = self._teacher_logits(ids, docs, mask)
            out = model(ids, doc_ids=docs, token_mask=docs != 0)  # left padding is document 0
            z = out.logits[mask]
            total, per_teacher = reverse_kl(z, teacher_logits, self.weights, cfg.chunk)
            if self.correction == "decoupled":  # each position weighted by its completion's truncated ratio
                logp = next_token_logprobs(out.logits.detach(), ids, docs)
                weights, _ = rollout_correction(logp, r.sampler_logp[s], mask, "sequence", cfg.is_cap, 0.0,
                                                float("inf"))
                total = total * weights[mask]
                is_sum.add_(weights[mask].sum().double())
            loss = total.sum() / max(n_tok, 1)
            loss_total.add_(loss.detach().double())
            part, most = self._sums(z, ids, mask, r.sampler_logp[s], per_teacher)
            sums.add_(part)
            torch.maximum(maxima, most, out=maxima)
            return loss, out

        aux = backward_micro_batches(model, slices, loss_of, scaler, ctx.recipe.train,
                                       ctx.par.summed_ranks)
        sums = ctx.par.all_reduce_sum(torch.cat([sums, is_sum[None], loss_total[None]]))
        if ctx.par.distributed:
            torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX)
        totals = sums.tolist()
        tokens = max(totals[0], 1.0)
        k = len(self.teachers)
        rows = ctx.par.all_reduce_sum(torch.tensor([float(r.input_ids.shape[0]), float((r.doc_ids != 0).sum())],
                                                   dtype=torch.float64, device=device)).tolist()
        metrics = {"entropy": totals[1] / tokens, "response_length": totals[0] / rows[0],
                   **{f"reverse_kl/teacher{i}": v / tokens for i, v in enumerate(totals[2:2 + k])},
                   **parity_metrics(totals[2 + k:-2], maxima.tolist()), **engine_metrics,
                   "rollout_corr/is_mean": totals[-2] / tokens if self.correction == "decoupled" else 1.0}
        return StepResult(loss=sums[-1].float(), tokens=int(rows[1]), metrics=metrics, moe_stats=aux.moe_stats,
                          indexer_loss=aux.indexer_loss)

    @torch.no_grad()
    def evaluate(self, model: Model) -> dict[str, float]:
        if not self.eval_prompts:
            return {}
        ctx, par = self.ctx, self.ctx.par
        mine = self.eval_prompts[par.data_rank::par.data_world]
        r = self._rollouts(model, mine, rank_generator(EVAL_SEED, par))
        sums = torch.zeros(1 + len(self.teachers), dtype=torch.float64, device=ctx.dev.torch_device)
        with evaluating(model):
            for s in r.micro_batches(self.cfg.micro_batch_size):
                ids, docs, mask = r.input_ids[s], r.doc_ids[s], r.mask[s]
                _, per_teacher = reverse_kl(model(ids, doc_ids=docs).logits[mask],
                                            self._teacher_logits(ids, docs, mask), self.weights, self.cfg.chunk)
                sums += torch.cat([mask.sum().double()[None], per_teacher.sum(dim=1).double()])
        totals = par.all_reduce_sum(sums).tolist()
        per = [v / max(totals[0], 1.0) for v in totals[1:]]
        metrics = {"eval_reverse_kl": sum(w * v for w, v in zip(self.weights, per)),
                   **{f"eval_reverse_kl/teacher{i}": v for i, v in enumerate(per)}}
        if all("answer" in p.record for p in self.eval_prompts):
            def em(m: Model) -> dict[str, float]:
                return exact_match_by_set(m, self.eval_sets, ctx.tokenizer, self.thinking, self.sampling, par,
                                          ctx.dev.torch_device)
            metrics.update(em(model))
            if self.teacher_exact_match is None:  # the teachers do not change
                self.teacher_exact_match = {
                    key.replace("eval_exact_match", f"eval_exact_match/teacher{i}", 1): v
                    for i, t in enumerate(self.teachers) for key, v in em(t).items()}
            metrics.update(self.teacher_exact_match)
        return metrics

    def state_dict(self) -> dict:
        return {"order": self.order.state_dict(), "generator": generator_state(self.generator)}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def load_state_dict(self, state: dict) -> None:
        self.order.load_state_dict(state["order"])
        set_generator_state(self.generator, state["generator"])

    def preflight(self) -> dict:
        return {"prompts": len(self.prompts), "eval_prompts": len(self.eval_prompts),
                "teachers": [(t.path, t.weight) for t in self.cfg.teachers]}

    def summary(self) -> dict:
        return {"prompts": len(self.prompts), "eval_prompts": len(self.eval_prompts), "prompt_epoch": self.order.epoch,
                "teachers": [{"path": t.path, "weight": t.weight} for t in self.cfg.teachers]}

    def probe_batch(self, rows: int) -> Batch:
        return probe_batch(self.prompts, rows, self.ctx.recipe.data.seq_len, self.ctx.tokenizer.pad_id)


def build(ctx: TrainContext) -> DistillObjective:
    return DistillObjective(ctx)
