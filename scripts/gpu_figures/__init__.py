"""scripts/gpu_figures.py's code, a module a section of its report (gpu_figures.json's `sections`): correctness,
training, trainer, generation, ctranslate2, multi30k_published, distributed. Beside them: cli (the command line and
the order of the sections), sizes (the sizes measured, full and --tiny), run (a run's time limit and the recording of
each measurement), compilation (eager, compiled and captured: how each system is run), names (how items are named),
device (what the report says of the device, MFU), summary (the ratios of the recorded figures, each system at its
best) and report (the JSON and Markdown files, --merge).
"""
