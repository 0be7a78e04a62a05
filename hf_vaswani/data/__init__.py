"""Parallel text and its preparation (§5.1): corpora, the demo corpus, the BPE vocabulary, token batches."""
