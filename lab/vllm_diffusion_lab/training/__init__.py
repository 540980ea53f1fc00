"""What the training tools (``tools/train_sdar.py``, ``train_tokenizer.py``,
``sample_sdar.py``, ``cast_checkpoint.py``, ``grow_depth.py``) share: the chat tokenizer,
a plain block-diffusion decoding loop for evaluation, checkpoint writing and depth growth."""
