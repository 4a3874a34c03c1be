"""Memory: large buffers (host and device), the byte ledger every figure is read from, and the pages of
released host buffers kept for reuse.

Owns every large allocation and free of the engine (see [Note: the heap between steps] in ``buffers.py``).
Imports: nothing else of the engine (the floor every layer stands on).
"""
