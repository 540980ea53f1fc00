"""The vocabulary of one denoising step, shared by every layer of the package: ``request`` (a
request's state and block canvas), ``slots`` (state per request slot), ``hooks`` and
``keys`` (what the forward hooks see and answer), ``plans`` (what a policy decides for a
step), ``rows``, ``failures``. Nothing here imports the other layers, or vLLM.
"""
