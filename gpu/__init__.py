"""GPU workers and their backends. ``torch``/``transformers`` are imported only
by ``gpu.backends.transformers_backend``, so nothing else ever loads them."""
