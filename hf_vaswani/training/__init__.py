"""The paper's training recipe (§5): settings, the run folder, the trainer, schedule, callbacks, averaging."""
