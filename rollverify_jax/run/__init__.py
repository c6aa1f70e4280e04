"""A run's assembly and life cycle: the spec read from gin once, the builder, the trainer and its state, the
workdir, evaluation, checkpoints, metrics, stops."""
