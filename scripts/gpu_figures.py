"""GPU figures: correctness on the device, training and decoding speed against MarianMTModel and CTranslate2, and the
published Multi30k recipe end to end, each section alone or several in one command that keeps to a time limit.

    python scripts/gpu_figures.py [--only SECTION ...] [--time-limit 8] [--output-dir DIR]
    python scripts/gpu_figures.py --only multi30k_published --multi30k DIR --time-limit 9.5
    python scripts/gpu_figures.py --merge A/gpu_figures.json B/gpu_figures.json --output-dir DIR
    python scripts/gpu_figures.py --tiny --time-limit 1        # tiny sizes on the CPU, well under a minute

Runs on CUDA where available, else on the CPU. The training and generation sections measure hf_vaswani and
MarianMTModel each eager, compiled (torch.compile) and captured (CUDA graphs, on CUDA only); the summary divides each
system's best by the other's, naming the items that won. Writes gpu_figures.json and gpu_figures.md into --output-dir
(default: $OUT where set, else gpu_figures/) after every measurement, so a killed run keeps what it measured; what does
not run is recorded with its reason (no GPU, too little time left, a package missing). The summary is recomputed at
every write; --merge joins the reports of several runs (one per device call) into one and recomputes it. A device
machine gets no ../shared: copy the Multi30k corpus into an ignored folder of the repository and pass that folder as
--multi30k.

The code is the package gpu_figures/ beside this file (which `import gpu_figures` finds before this file): a module a
section of the report, named as the section is.
"""

from gpu_figures.cli import main

if __name__ == "__main__":
    main()
