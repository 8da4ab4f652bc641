"""Convergence fidelity tools: compare a run with a reference under a tolerance profile, store
golden references, and run a recipe's variant matrix. The signals they read are recorded by the
training loop (trex.train.signals).

    runs      reading a run directory or a golden file into aligned per-step signals
    profiles  tolerance profiles (bitwise, layout, precision, vendor) with their rationale
    compare   the measures and the verdict
    golden    export a run as a golden reference file
    report    the text table and the PNG
    matrix    a recipe's variants against its fp32 single-process control
    cli       `trex fidelity compare | export | matrix | profiles`
"""
