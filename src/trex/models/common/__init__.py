"""The parts the DeepSeek model families share, each in a file named by the part.

    config.py   ConfigError, need, read_config_json, the generic config.json fields, YarnScaling,
                rope_fields, the MoE layer kinds, preset lookup (no torch: ``trex --help`` reads presets)
    rope.py     rope_inv_freq (YaRN), apply_rope (interleaved pairs)
    norm.py     RMSNorm, unweighted_rms_norm
    linear.py   linear_fp32, QuantSim, QuantLinear, spread_quant (the served quantisation, simulated)
    moe.py      the router (Gate), routed experts sorted by expert (Experts), SharedExpert, MoE, MoEStats
    context.py  segments, SequenceShard, SequenceContext (ids, documents, positions, shard rows, RoPE
                tables), DecodeCacheLike, DecodeSteps (a cache's shared bookkeeping), shift_labels
    heads.py    ModelOutput, init_parameters

A file here imports only torch, trex.kernels, trex.models.cross_entropy and other files here: never an
architecture (deepseek_v4, deepseek_v41, ...) nor what sits above them (tests/test_models_layering.py).
Nothing is exported from this package's namespace, so importing ``common.config`` imports no torch.
"""
