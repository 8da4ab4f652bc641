"""What the planner needs to know about a model, read from the model itself (built on meta).

Parameter counts per module type, which parameters train (the lightning indexer is frozen in
post-training, `trex.train.moe_balance.freeze_indexer`), which optimizer each one gets
(`trex.train.optim.classify`), the largest block (the FSDP unit gathered at once) and the
Newton-Schulz work of one Muon step. DeepSeek-V4.1's Engram tables are counted apart: they are
split by rows over every rank outside FSDP (trex.parallel.engram), frozen or trained with row-wise
AdaGrad by ``[train] engram``, so no other count includes them.

Every family is read the same way; what its model built on meta lacks (DeepSeek-V3.2's lightning indexer,
counted from its config: frozen, in each block's FSDP unit) its plan terms add (``counted_model``), and its
MoE layers and the Engram rows a token reads come from them too (trex.plan.terms).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trex.models.registry import AnyConfig
from trex.plan.terms import terms

# Module types, first match wins (names follow the official checkpoint, see trex.checkpoint.naming).
MODULE_TYPES = (
    ("embedding", r"^embed\."),
    ("lm_head", r"^head\."),
    ("engram_tables", r"\.engram\.embed\."),
    ("engram", r"\.engram\."),
    ("indexer", r"\.attn\.indexer\."),
    ("compressor", r"\.attn\.compressor\."),
    ("attention", r"\.attn\."),
    ("routed_experts", r"\.ffn\.experts\."),
    ("shared_expert", r"\.ffn\.shared_experts\."),
    ("router", r"\.ffn\.gate\."),
    ("dense_mlp", r"\.ffn\.w[123]\."),  # the DeepSeek-V3 family's first first_k_dense_replace layers
    ("mhc", r"(^|\.)hc_(attn|ffn|head)\."),
    ("norms", r"norm\.weight$"),
    ("mtp_projections", r"\.(e_proj|h_proj)\."),
)
# Parameters tensor parallelism splits (trex.plan.layout.Layout.tp). The DeepSeek-V3 family as
# trex.models.deepseek_v3.tp_plan: MLA's up projections column-wise and output row-wise (the low-rank down
# projections, their norms and the router stay whole on every TP rank), the dense FFN column/row-wise, an MTP
# block's eh_proj whole (Megatron's MTP splits it column-wise). V4 and V4.1 as trex.models.deepseek_v4.tp_plan and
# tp_plan_v41: wq_b by heads, the per-head attn_sink with them, wo_a by whole output groups, wo_b row-wise (wq_a, the
# K = V head wkv, the compressor, the indexer, mHC, the norms, the router and V4.1's Engram whole;
# tests/test_plan_tp.py checks this against both plans). Both: the shared experts column/row-wise, embedding and
# head by vocabulary. Routed experts are split by expert parallelism instead (counted apart, ``experts``).
TP_SPLIT = (r"\.attn\.(wq_b|wkv_b|wo|wo_a|wo_b)\.|\.attn\.attn_sink$|\.ffn\.(w[123]|shared_experts)\.|"
            r"^embed\.|^head\.")
# The trained matmuls among the parameters TP leaves whole, which every TP rank runs on all of the group's rows
# (``ModelFacts.tp_whole_matmul``): the attention's (down projections, V4's K = V head and compressor), the router,
# V4.1's Engram value/key projection (its ``wkv``; Engram is replicated over the TP group, tp_plan_v41).
WHOLE_MATMUL = r"\.attn\.|\.ffn\.gate\.|\.engram\.wkv\."
INDEXER = ".attn.indexer."
TABLE = ".engram.embed."
NS_ITERATIONS = 10  # DeepSeek-V4's hybrid Newton-Schulz: 8 + 2 iterations (trex.train.optim.OptimSection)


@dataclass(frozen=True)
class ModelFacts:
    """Parameter counts (elements, not bytes) of one model, MTP modules included unless stated."""

    by_type: dict[str, int]  # main model (no MTP) per module type
    mtp: int  # all MTP modules
    total: int  # main model, as trex.models.count_parameters (Engram tables included)
    active: int  # main model, per token (k routed experts of E; the Engram rows read)
    trainable: int  # everything the optimizer updates (MTP included, indexer frozen), Engram tables apart
    experts: int  # routed-expert parameters (main + MTP), split by expert parallelism
    muon: int  # trainable parameters under Muon (when optim.name = "muon")
    adamw: int  # trainable parameters under AdamW (when optim.name = "muon")
    block_dense: int  # largest block without its routed experts (one FSDP unit)
    block_experts: int  # routed experts of one block
    root: int  # parameters outside every block (embedding, LM head, mHC head, final norm): the FSDP root unit
    block_trainable: tuple[int, ...]  # trainable parameters of each block: layers.0 ... then mtp.0 ...
    largest_muon_matrix: int  # elements of the largest dense Muon parameter
    muon_ns_flops: float  # FLOPs of one Newton-Schulz pass over every Muon matrix
    engram_tables: int = 0  # V4.1: elements of every Engram table (split over all ranks, outside FSDP)
    engram_rows: int = 0  # V4.1: rows of every Engram table (row-wise AdaGrad keeps one fp32 each)
    # what tensor parallelism leaves whole on every TP rank (TP_SPLIT; routed experts are never among them)
    tp_whole_stored: int = 0  # of ``stored``
    tp_whole_trainable: int = 0  # of ``trainable``
    tp_whole_muon: int = 0  # of ``muon``
    tp_whole_block: int = 0  # of ``block_dense`` (the largest block)
    tp_whole_root: int = 0  # of ``root`` (the final norm: embedding and head are split)
    tp_whole_matmul: int = 0  # weights of the whole trained matmuls every TP rank runs on the group's tokens (per
    #                          token, main layers and MTP blocks: WHOLE_MATMUL): the work TP repeats on each rank
    tp_whole_indexer: bool = False  # the lightning indexer (frozen, forward only) is whole on every TP rank (V4:
    #                                 it is among the model's parameters and TP_SPLIT leaves it; V3.2: its
    #                                 ``counted_model`` says so), so each rank runs all of it on the group's tokens
    indexer: int = 0  # the lightning indexers' parameters (main and MTP), what trains with Layout.train_indexer
    indexer_muon: int = 0  # of ``indexer``, those Muon updates when it trains (its matrices)

    def per_tp_rank(self, total: int, whole: int, tp: int) -> float:
        """Elements of ``total`` one of ``tp`` TP ranks holds, ``whole`` of them not split (routed experts split
        by EP over the TP ranks too)."""
        return whole + (total - whole) / tp

    def trained_per_tp_rank(self, tp: int, train_indexer: bool) -> tuple[float, float]:
        """(trained, of them under Muon) elements on one of ``tp`` TP ranks, before FSDP: ``trainable`` and
        ``muon``, plus the lightning indexer (whole under TP) when it trains."""
        indexer, indexer_muon = (self.indexer, self.indexer_muon) if train_indexer else (0, 0)
        return (self.per_tp_rank(self.trainable, self.tp_whole_trainable, tp) + indexer,
                self.per_tp_rank(self.muon, self.tp_whole_muon, tp) + indexer_muon)

    @property
    def stored(self) -> int:
        """Every parameter held on devices (frozen ones too), the Engram tables apart."""
        return self.total + self.mtp - self.engram_tables

    @property
    def dense(self) -> int:
        """The parameters FSDP shards and gathers that are not routed experts."""
        return self.stored - self.experts


def module_type(name: str) -> str:
    for kind, pattern in MODULE_TYPES:
        if re.search(pattern, name):
            return kind
    raise ValueError(f"no module type for parameter {name!r}; extend trex.plan.model_facts.MODULE_TYPES")


def _ns_flops(shape: tuple[int, ...], row_blocks: list[int]) -> float:
    """One hybrid Newton-Schulz of a parameter: per iteration X X^T, A A and (bA + cA^2) X."""
    *batch, rows, cols = shape
    count = 1
    for b in batch:
        count *= b
    total = 0.0
    for r in row_blocks or [rows]:
        n, m = min(r, cols), max(r, cols)
        total += count * NS_ITERATIONS * (4 * n * n * m + 2 * n**3)
    return total


def _build_facts(cfg: AnyConfig) -> ModelFacts:
    from trex.models import build_model
    from trex.train.optim import classify

    family = terms(cfg)
    cfg, indexer, index_whole = family.counted_model(cfg)  # V3.2: the dense V3 model, the indexers added below
    model = build_model(cfg, device="meta")
    by_type: dict[str, int] = {kind: 0 for kind, _ in MODULE_TYPES}
    mtp = experts = trainable = muon = tables = rows = 0
    blocks: dict[str, list[int]] = {}  # block prefix -> [dense, routed experts, trainable, TP-whole] parameters
    root = root_whole = 0
    whole_stored = whole_trainable = whole_muon = whole_matmul = 0
    whole_indexer = False
    largest = 0
    ns = 0.0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            mtp += p.numel()
        else:
            by_type[module_type(name)] += p.numel()
        if TABLE in name:  # neither a block's FSDP unit nor the root's
            tables, rows = tables + p.numel(), rows + p.shape[0]
            continue
        is_expert = ".ffn.experts." in name
        experts += p.numel() if is_expert else 0
        whole = not is_expert and not re.search(TP_SPLIT, name)
        whole_stored += p.numel() if whole else 0
        trained_matmul = p.dim() == 2 and re.search(WHOLE_MATMUL, name) is not None and INDEXER not in f".{name}"
        whole_matmul += p.numel() if whole and trained_matmul else 0
        whole_indexer = whole_indexer or (whole and INDEXER in f".{name}")
        block = re.match(r"^(layers|mtp)\.\d+\.", name)
        if block:
            entry = blocks.setdefault(block.group(0), [0, 0, 0, 0])
            entry[1 if is_expert else 0] += p.numel()
            entry[3] += p.numel() if whole else 0
        else:
            root += p.numel()
            root_whole += p.numel() if whole else 0
    indexers = indexer_muon = 0
    for name, p, rule, row_blocks in classify(model):
        if INDEXER in f".{name}":  # frozen unless Layout.train_indexer: counted apart
            indexers += p.numel()
            indexer_muon += p.numel() if rule.muon else 0
            continue
        if TABLE in name:
            continue
        trainable += p.numel()
        whole = ".ffn.experts." not in name and not re.search(TP_SPLIT, name)
        whole_trainable += p.numel() if whole else 0
        block = re.match(r"^(layers|mtp)\.\d+\.", name)
        if block:
            blocks[block.group(0)][2] += p.numel()
        if rule.muon:
            muon += p.numel()
            whole_muon += p.numel() if whole else 0
            ns += _ns_flops(tuple(p.shape), row_blocks)
            if p.dim() == 2:
                largest = max(largest, p.numel())
    if indexer:  # frozen: stored, in each block's FSDP unit, never trained; index_whole of it left whole by TP
        by_type["indexer"] += cfg.num_hidden_layers * indexer
        mtp += cfg.num_nextn_predict_layers * indexer
        for entry in blocks.values():
            entry[0] += indexer
            entry[3] += index_whole
        whole_stored += len(blocks) * index_whole
        whole_indexer = index_whole == indexer
        indexers = indexer_muon = len(blocks) * indexer  # counted from the config: its matrices (and a norm's 2 x c_I)
    total = sum(by_type.values())
    largest_block = max(blocks.values(), key=lambda v: v[0])
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    moe_layers = family.moe_layers(cfg, cfg.num_hidden_layers)
    inactive = moe_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert
    if tables:  # the rows a token reads are active
        inactive += tables - family.table_reads(cfg)
    return ModelFacts(
        by_type=by_type, mtp=mtp, total=total, active=total - inactive, trainable=trainable, experts=experts,
        muon=muon, adamw=trainable - muon, block_dense=max(v[0] for v in blocks.values()),
        block_experts=max(v[1] for v in blocks.values()), root=root,
        block_trainable=tuple(v[2] for v in blocks.values()), largest_muon_matrix=largest, muon_ns_flops=ns,
        engram_tables=tables, engram_rows=rows, tp_whole_stored=whole_stored, tp_whole_trainable=whole_trainable,
        tp_whole_muon=whole_muon, tp_whole_block=largest_block[3], tp_whole_root=root_whole,
        tp_whole_matmul=whole_matmul, tp_whole_indexer=whole_indexer, indexer=indexers, indexer_muon=indexer_muon)


_CACHE: dict[str, ModelFacts] = {}
_BY_OBJECT: dict[int, tuple[AnyConfig, ModelFacts]] = {}  # id -> (the config, held so its id is not reused)


def model_facts(cfg: AnyConfig) -> ModelFacts:
    """Facts of ``cfg`` (cached by the config's contents; the same config object, as a search passes it thousands of
    times, without reading them again)."""
    held = _BY_OBJECT.get(id(cfg))
    if held is not None and held[0] is cfg:
        return held[1]
    key = repr(cfg)
    if key not in _CACHE:
        _CACHE[key] = _build_facts(cfg)
    _BY_OBJECT[id(cfg)] = (cfg, _CACHE[key])
    return _CACHE[key]
