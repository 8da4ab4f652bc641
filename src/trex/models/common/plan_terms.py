"""The planner's memory and time terms: what each family's ``plan_terms`` module provides, and what two families share.

``trex.plan`` (the cluster planner) knows no family: it reaches a config's terms through its Architecture
(``trex.models.registry.architecture(cfg).load("plan_terms")``, trex.models.common.architecture) and sums them
over blocks, micro-batches, pipeline stages and collectives. A family's ``plan_terms`` module
(``trex.models.deepseek_v4.plan_terms``: V4 and V4.1; ``trex.models.deepseek_v3.plan_terms``) provides the
functions below (:data:`FUNCTIONS`); every count is a Python int or float.

Conventions: ``cfg`` the family's config; ``S`` the tokens of one sequence (a batch row; the whole sequence,
also under context parallelism); ``b`` bytes of an element of the compute dtype (2 for bf16, 4 for fp32);
``cp`` the context-parallel ranks a sequence is split over (a rank keeps its own S / cp rows); ``tp`` the
tensor-parallel ranks. Bytes are per device, for one
sequence unless stated; a *layer kind* is an opaque string the family's ``main_blocks`` / ``mtp_kind`` hand
out and its other functions take back.

Activations (bytes autograd keeps for backward):

    main_blocks(cfg) -> list[(kind, mlp_type)]
                                            each main layer's kind and FFN type ("moe", "dense", V4's hash MoE),
                                            first layer first
    mtp_blocks(cfg) -> int                  MTP blocks the model trains (0: none, or a drafter carried untrained)
    mtp_kind(cfg) -> str                    the layer kind of an MTP block (its FFN is "moe")
    stream_bytes(cfg, b, rows=1) -> float   per token: a block's input, all a checkpointed block keeps (1 / rows
                                            of it under sequence parallelism over ``rows`` tp ranks)
    block(cfg, kind, mlp_type, S, b, cp=1, tp=1, rows=1) -> LayerActivations
                                            one block's saved bytes on one rank
    weight_copies(cfg, kind, b) -> float    fp32 copies of weights one block keeps at a lower compute dtype
    backward_workspace(cfg, kind, S, b, cp=1, tp=1, rows=1) -> float
                                            transient bytes while one block runs backward, on top of what it saved
    model_level(cfg, S, b, heads=True, tp=1, rows=1) -> float
                                            bytes outside the blocks (ids, heads, MTP inputs, their weight copies);
                                            ``heads=False``: what is left once the heads are back-propagated

    The fused head + loss backward is shared: :func:`head_backward_workspace` here.

Time (FLOPs per token; bytes per sequence row and pass):

    moe_layers(cfg, layers) -> int          MoE layers among the first ``layers`` main layers (a pipeline stage is
                                            charged as the busiest)
    dense_ffn_flops(cfg) -> int             forward FLOPs per token of the dense (non-MoE) FFN layers' matmuls
    busiest_shard_flops(cfg, seq_len, cp, total) -> float
                                            training FLOPs per token of the busiest of ``cp`` > 1 shards;
                                            ``total(n)`` is the model's training FLOPs per token, the mean over
                                            positions 0..n-1 (trex.models.flops, memoised by the planner)
    kernel_extra_flops(cfg, seq_len) -> float
                                            training FLOPs per token the family's kernels run beyond the model
                                            FLOPs trex.models.flops counts (the MFU numerator): in the step time,
                                            not in the MFU; its forward third again in a recompute
    indexer_training_flops(cfg, seq_len) -> (split, whole)
                                            training FLOPs per token the lightning indexer's KL alignment adds when
                                            it trains ([train] indexer_loss > 0; the planner's default is frozen):
                                            the part TP splits by heads, and the part every TP rank runs whole (in
                                            the step time, not in the MFU)
    cp_traffic(cfg, seq_len, b) -> (halo, gathered)
                                            context-parallel bytes per row and pass for one rank: sent to the
                                            neighbours, and moved by ring collectives (all-gather / reduce-scatter)
    tp_split(cfg) -> dict[str, int]         what tensor parallelism splits, by name, each a size ``tp`` must divide
                                            (0: absent); NotImplementedError(reason) where the family's TP is not
                                            modelled
    tp_traffic(cfg, S, b, recompute, layers, cp=1, sp=True) -> float
                                            ring-collective buffer bytes (an all-reduce counts twice) one TP rank
                                            takes part in for one sequence through ``layers`` main layers, the MTP
                                            blocks and the heads, under ``recompute`` ("none", "selective", "full"),
                                            with sequence parallelism or without (``sp``): ``tp_ring_elements``
    table_reads(cfg) -> int                 elements of the row-split embedding tables (V4.1's Engram) one token
                                            reads (0: none)
    table_lookup_bytes(cfg, trained) -> int bytes per token the tables' all-to-all lookup moves (row ids, rows,
                                            and their gradients when ``trained``)

Facts and notes:

    counted_model(cfg) -> (cfg, per_block, per_block_whole)
                                            the config whose model (built on meta) the parameter count reads, and
                                            the frozen parameters per block (main layers and MTP) it lacks that the
                                            planner adds, ``per_block_whole`` of them left whole by TP
    notes(cfg, tp=1) -> list[str]           what a plan of ``cfg`` (at ``tp`` tensor-parallel ranks) says about how
                                            it was modelled
"""

from __future__ import annotations

from dataclasses import dataclass

from trex.models.common.cross_entropy import head_tiles

F32, I64 = 4, 8  # bytes of an fp32 element and of an int64 index

# what a family's plan_terms module defines (tests/test_plan.py checks every architecture's)
FUNCTIONS = ("main_blocks", "mtp_blocks", "mtp_kind", "stream_bytes", "block", "weight_copies", "backward_workspace",
             "model_level", "moe_layers", "dense_ffn_flops", "busiest_shard_flops", "kernel_extra_flops",
             "indexer_training_flops", "cp_traffic", "tp_split", "tp_traffic", "table_reads", "table_lookup_bytes",
             "counted_model", "notes")


@dataclass(frozen=True)
class LayerActivations:
    """Saved bytes of one block for one sequence: both mHC sites (0 without mHC), attention, FFN."""

    mhc: float
    attention: float
    moe: float

    @property
    def total(self) -> float:
        return self.mhc + self.attention + self.moe


def rms_norm(D: int) -> float:
    """Per row, a weighted RMSNorm of width D (reference kernel): fp32 input, rstd, normalised pre-weight value."""
    return F32 * (2 * D + 1)


def head_backward_workspace(cfg, tokens: int, tp: int = 1) -> float:
    """Transient bytes of one fused head + loss backward (cross_entropy.head_nll) over ``tokens``:
    one tile's fp32 logits, the fp32 hidden-state gradient, the head weight's fp32 copy and its
    fp32 gradient. Under tensor parallelism (vocabulary-parallel head and loss) a rank holds V / tp of the
    vocabulary of every token of the group."""
    V, d = cfg.vocab_size // tp, cfg.hidden_size
    block, rows = head_tiles(tokens, V)
    return F32 * (block * rows + tokens * d + 2 * V * d)


@dataclass
class SplitBlock:
    """What one block moves between tensor-parallel ranks, in elements of one context-parallel rank's rows (s of
    them): ``ffn_out`` whether its FFN has a split part (a dense FFN or shared experts) whose output is summed;
    ``entries`` what enters the split regions, its gradient summed in backward (the latents a split attention
    reads, the FFN's input); ``params`` the elements of the parameters it computes on this rank's rows under
    sequence parallelism (norms, mHC), whose gradients are summed; ``whole_rows`` the elements of a region run on
    the whole rows under sequence parallelism (V4.1's Engram: its input gathered, its output's gradient
    gathered)."""

    ffn_out: bool
    entries: float
    params: float = 0.0
    whole_rows: float = 0.0


def tp_ring_elements(s: int, d: int, blocks: list[SplitBlock], heads: int, root_params: float, stats: float,
                     recompute: str, sp: bool) -> float:
    """Ring-collective elements (an all-reduce counts twice: a reduce-scatter and an all-gather; an all-gather its
    output, a reduce-scatter its input) one TP rank takes part in for s rows through ``blocks``, ``heads``
    embeddings and vocabulary-parallel losses, as trex.parallel.tensor_parallel runs them. ``stats``: each loss's
    elements per row summed in the compute dtype's units (its statistics and its hidden state's gradient, fp32);
    ``root_params``: the parameters outside the blocks computed on this rank's rows under sequence parallelism.

    Without sequence parallelism each block sums its attention's and split FFN's outputs (forward), the gradients
    of what enters them (backward), and its forward's again in a recompute (full: both, selective: the attention);
    each embedding sums [s, d]. With it the residual stream holds 1 / tp of the rows: each block all-gathers the
    norms' outputs into its two regions and reduce-scatters their outputs (forward: 4 x [s, d]), all-gathers the
    outputs' gradients (backward: 2 x [s, d]) besides the entries' sums, sums its row-computed parameters'
    gradients, and runs the forward's again in a recompute (full: 4 x [s, d], selective: the attention site's 2);
    each embedding reduce-scatters forward and all-gathers backward, each head all-gathers its input rows."""
    total = 0.0
    again = {"none": 0.0, "selective": 1.0, "full": 2.0}[recompute]  # regions run again (attention first)
    for blk in blocks:
        if sp:
            # forward 4 x [s, d], backward 2 (the outputs' gradients) and the sums; the recompute's again
            total += (6 + 2 * again) * s * d + 2 * blk.entries + 2 * blk.params
            total += blk.whole_rows * (2 + (recompute == "full"))  # gathered forward (and again), backward
        else:
            out = [s * d, s * d if blk.ffn_out else 0.0]
            total += 2 * sum(out) + 2 * blk.entries + 2 * sum(out[:int(again)])
    # embeddings (a sum, or a reduce-scatter and its gradient's gather); the losses' statistics
    total += heads * (2 * s * d + 2 * stats * s)
    if sp:
        total += heads * s * d + 2 * root_params
    return total
