"""One SFT step's forward and backward of the tiny model at a layout, for tests/test_context_parallel.py.

    torchrun --nproc-per-node N tests/context_parallel_worker.py OUT.pt,DP_SHARD,EP,CP[,COMPILED[,V3[,TP[,SAMPLE[,GRPO[,SP]]]]]] ...
    python tests/context_parallel_worker.py OUT.pt            (one process: the reference)

Several layouts run one after the other in one launch, on one process group (each its own mesh and model).

COMPILED = 1: every block checkpointed (full) and compiled with fullgraph=True (the aot_eager
backend: the graphs, partitioned for the recompute as Inductor's are, without code generation); COMPILED = 2: each
block's attention site checkpointed (selective), eager.
V3 = 1: DeepSeek-V3's tiny preset (MLA, a dense first layer, group-limited routing, MTP), not V4's; V3 = 2:
tiny-v3.2 (its indexer picking 8 keys, their KL trained as the sparse stage's ``[train] indexer_loss``).
V3 = 3: V4's tiny model with its CSA layers' indexer KL trained likewise; V3 = 4: tiny-v4.1 (CSA2, Engram, the
candidate pool). TP: tensor-parallel size
(tests/test_tensor_parallel.py). SAMPLE = 1: after the step, the in-process rollout engine samples a few tokens
of PROMPTS with fixed draws (temperature 1), as GRPO's rollouts do (decode cache and all). GRPO = 1: the step's
loss is GRPO's (``grpo_loss``), not SFT's (one data-parallel rank). SP = 0: tensor parallelism without sequence
parallelism (``[parallel] sequence_parallel = false``; default 1).

The global batch (ROWS rows of SEQ tokens, packed documents that cross every shard boundary) is the
same at every layout; each data-parallel rank takes its rows. Rank 0 saves the step's loss, the
per-token NLL of its rows and every parameter's full gradient.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from trex import device as device_layer
from trex.data.loader import Batch
from trex.models import build_model
from trex.models.common.context import shift_labels
from trex.models.common.cross_entropy import IGNORE_INDEX
from trex.models.deepseek_v4.config import tiny
from trex.models.registry import get_preset
from trex.parallel.mesh import init_parallel, shutdown_distributed
from trex.parallel.plan import apply_activation_checkpointing, apply_compile, apply_parallelism
from trex.posttrain.grpo_loss import policy_loss, token_weights
from trex.posttrain.objective import backward_micro_batches, next_token_logprobs, next_token_nll, token_logprobs
from trex.posttrain.sft import accumulate_gradients
from trex.precision import DynamicLossScaler, PrecisionPolicy
from trex.rollout.engine import InProcessEngine
from trex.rollout.sampling import SamplingParams
from trex.train.config import TrainSection

ROWS, SEQ = 4, 64
SINKHORN = 3  # mHC's Sinkhorn iterations (V4: 20): the same loop, a third of the ops to trace when compiled
# document lengths per row: boundaries inside shards, on shard edges (16, 32, 48) and windows cut by them
DOCS = [[5, 30, 29], [17, 3, 44], [16, 16, 32], [64]]
# SAMPLE: prompt lengths (the batch's rows' first tokens), tokens drawn; three rows, so that the prefill's 27 and each
# decode step's 3 tokens do not split evenly over the tp ranks an expert-parallel group spans (padded there)
PROMPTS, NEW_TOKENS = (5, 9, 3), 6


def global_batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (ROWS, SEQ), generator=g)
    docs = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in DOCS])
    labels = ids.clone()
    labels[0, :9] = -100  # an unlabelled prompt
    return Batch(ids, labels, docs, 0, ids.numel(), torch.ones_like(ids, dtype=torch.bool))


def rows(batch: Batch, index: slice) -> Batch:
    return Batch(batch.input_ids[index], batch.labels[index], batch.doc_ids[index], 0, batch.input_ids[index].numel(),
                 batch.token_mask[index])


def step(out: str, dp_shard: int = 1, ep: int = 1, cp: int = 1, compiled: int = 0, v3: int = 0, tp: int = 1,
         sample: int = 0, grpo: int = 0, sp: int = 1, last: bool = True) -> None:
    """One layout's step; ``last``: leave the process group after it (`shutdown_distributed`)."""
    dev = device_layer.Device("cpu")
    par = init_parallel(1, dp_shard, ep, 120, dev, cp=cp, tp=tp, sequence_parallel=bool(sp))
    preset = {1: "tiny-v3", 2: "tiny-v3.2"}.get(v3)
    cfg = (get_preset(preset) if preset else replace(get_preset("tiny-v4.1"), hc_sinkhorn_iters=SINKHORN) if v3 == 4
           else tiny(hc_sinkhorn_iters=SINKHORN))
    model = build_model(cfg, seed=0).train()
    model.align_indexer = v3 in (2, 3)
    if compiled:  # the plan's order: activation checkpointing, compile, then (below) CP, EP and FSDP2
        apply_activation_checkpointing(model, "full" if compiled == 1 else "selective")
    if compiled == 1:
        apply_compile(model, fullgraph=True, backend="aot_eager")
    apply_parallelism(model, par, PrecisionPolicy.resolve("fp32", dev))
    per_rank = ROWS // par.data_world
    mine = rows(global_batch(), slice(par.data_rank * per_rank, (par.data_rank + 1) * per_rank))
    train = TrainSection(mtp_weight=0.3, balance_alpha=0.01, indexer_loss=0.5 if v3 in (2, 3) else 0.0,
                         freeze_indexer=v3 not in (2, 3))
    if grpo:
        loss = grpo_loss(model, mine, train, par)
    else:
        lm, mtp, _ = accumulate_gradients(model, [mine], train, DynamicLossScaler(enabled=False), par)
        loss = par.all_reduce_sum(torch.stack([lm, mtp]))
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for n, p in model.named_parameters() if p.grad is not None}
    # the per-position NLL checks how shards gather; compiled, it runs the blocks eagerly: under no_grad their
    # graphs would be traced again (a new grad mode), a third of this layout's time for what the loss and the
    # gradients above already check of the compiled blocks
    with torch.no_grad(), torch.compiler.set_stance("force_eager" if compiled == 1 else "default"):
        nll = next_token_nll(model, mine.input_ids, mine.doc_ids, heads=1 if v3 == 4 else 2).token_nll
    samples = _sample(model) if sample else None
    if par.rank == 0:
        torch.save({"loss": loss, "nll": [t[:1] for t in nll], "grads": grads, "samples": samples}, out)
    del model
    if last:
        shutdown_distributed()


def grpo_loss(model, batch: Batch, train: TrainSection, par) -> torch.Tensor:
    """GRPO's step on the batch's labelled tokens as completions, as trex.posttrain.grpo computes it: the reference's
    log-probs through the fused head (``token_logprobs``: the frozen model's path, here the model itself before
    the step), the training forward's logits and their next-token log-probs, the clipped surrogate against old
    log-probs moved off the current ones (some ratios clipped) plus the k3 KL, token-aggregated, through the
    objective's micro-batch loop (balance and indexer terms, the MTP anchor); backward. Returns the loss [1]."""
    if par.data_world != 1:
        raise ValueError("grpo_loss: one data-parallel rank (its token counts are the batch's)")
    ids, docs = batch.input_ids, batch.doc_ids
    mask = shift_labels(batch.labels, 1, docs) != IGNORE_INDEX
    g = torch.Generator().manual_seed(2)
    shift, advantages = 0.3 * torch.randn(ids.shape, generator=g), torch.randn(ids.shape[0], generator=g)
    weights = token_weights(mask, "token", ids.shape[0], int(mask.sum()), ids.shape[1])
    with torch.no_grad():
        ref_logp = token_logprobs(model, ids, docs)
    losses = []

    def loss_of(_):
        out = model(ids, doc_ids=docs, token_mask=batch.token_mask)
        logp = next_token_logprobs(out.logits, ids, docs)
        pl = policy_loss(logp, logp.detach() + shift, advantages, weights, mask, 0.2, 0.28, ref_logp - shift, 0.05)
        losses.append(pl.loss.detach())
        return pl.loss, out

    backward_micro_batches(model, [None], loss_of, DynamicLossScaler(enabled=False), train, par.summed_ranks)
    return torch.stack(losses)


def _sample(model) -> tuple[list[list[int]], list[list[float]]]:
    """The in-process engine's completions of PROMPTS (the batch's rows' first tokens, left-padded together) under
    fixed draws, and their log-probabilities."""
    prompts = [global_batch().input_ids[i, :n].tolist() for i, n in enumerate(PROMPTS)]
    uniforms = torch.rand(len(prompts), NEW_TOKENS, generator=torch.Generator().manual_seed(1))
    drawn = InProcessEngine(model).generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS), uniforms, len(prompts))
    return drawn.completion_ids, drawn.logprobs


if __name__ == "__main__":
    layouts = [arg.split(",") for arg in sys.argv[1:]]
    for i, (out, *layout) in enumerate(layouts):
        step(out, *map(int, layout), last=i == len(layouts) - 1)
