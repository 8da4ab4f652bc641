"""The parts the DeepSeek model families share, each in a file named by the part.

    config.py   ConfigError, need, read_config_json, the generic config.json fields, YarnScaling,
                rope_fields, the MoE layer kinds, preset lookup (no torch: ``trex --help`` reads presets)
    rope.py     rope_inv_freq (YaRN), apply_rope (interleaved pairs), apply_rope_half (half-split pairs)
    norm.py     RMSNorm, unweighted_rms_norm, LayerNorm (fp32, with a bias)
    indexer.py  the lightning indexer's scores and top-k (select_topk), its KL to the main attention
                (alignment_kl), the picks' recall (picked_mass), the per-forward
                measures collected over blocks (take_indexer_measures)
    linear.py   linear_fp32, QuantSim, QuantLinear, spread_quant (the served quantisation, simulated)
    moe.py      the router (Gate), routed experts sorted by expert (Experts), SharedExpert, MoE, MoEStats
    context.py  segments, SequenceShard, SequenceContext (ids, documents, positions, shard rows, RoPE
                tables), DecodeCacheLike, DecodeSteps (a cache's shared bookkeeping), shift_labels
    heads.py    ModelOutput, Model (a model of any family, as generic code names it), init_parameters
    cross_entropy.py  IGNORE_INDEX, token_nll, head_nll (the LM head fused with the loss, in chunks)
    checkpoint_names.py  CheckpointNames (what a family says of its checkpoints: names, layouts, codecs),
                Target, the stacked routed experts' names (no torch)

A file here imports only torch, trex.kernels and other files here: never a family (deepseek_v4/,
deepseek_v3/, ...) nor what sits above them (tests/test_models_layering.py). Every importer names the file
that defines a part (no family module passes one on).
Nothing is exported from this package's namespace, so importing ``common.config`` imports no torch.
"""
