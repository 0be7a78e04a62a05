"""Using a trained model: the package's search, translation, scores, alignments, the shortlist, metrics."""
