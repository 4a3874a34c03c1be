"""Export: full weights out of a run, for other tools to read (not for resuming: that is ``checkpoint/``).

    full_weights.py  ``save_full_weights``: a live run's weights, unit by unit, to one file or a Hugging
                     Face directory
    hf.py            the Hugging Face model directory: the source's layout and config files, sharded
                     safetensors and their index
    adapters.py      LoRA adapters merged into their base weights on the way out
    writers.py       files of full tensors written one tensor at a time (``torch.save`` format, safetensors)
    digests.py       checksums of the bytes as they are written (sharded checkpoints, SHA256SUMS of exports)

Imports: ``engine`` (and ``errors``); ``checkpoint/`` imports the writers and the HF layout from here.
"""
