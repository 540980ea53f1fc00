"""The vocabulary of one denoising step, shared by every layer of the package.

``request`` (a request's diffusion state and its block canvas), ``slots`` (state kept
per request slot: the block buffer and the policies' slot tables), ``hooks`` (what the
model's hook points hand a policy and what the policy answers: row selections), ``keys``
(key selections), ``plans`` (what a policy decides for a step: which positions to compute
and commit). ``models/``, ``attention/``, ``policies/`` and ``worker/`` import these;
nothing here imports them, or vLLM.
"""
