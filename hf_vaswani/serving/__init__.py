"""Serving translations over HTTP: LibreTranslate's API, concurrent requests decoded in shared batches."""
