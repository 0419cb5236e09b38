"""What kvsim's policies are built with and run by (issue 55: kvsim/policies/ holds the policies alone): the
interface (``base``: Policy, Param, Capabilities), the registry (``registry``) and a checked choice of parameters
(``spec``), a run's configuration (``plan``), the declarations of a fast path and a tensor step (``slot_hooks``,
``tensor_hooks``), the serving layouts (``layouts``), RoPE's arithmetic (``rope``) and the bounds a policy is
measured against (``upper_bound``, ``optimal_blocks``). It stands on the policies' floor (docs/architecture.md).

A plugin imports ``kvsim.policies`` (``from kvsim.policies import Policy, register``), which re-exports the API.
Whichever module of this package is imported first, the policies are loaded with it: the one import below runs
``kvsim.policies`` (by name, as the registry imports each policy module), whose last line loads them once its
re-exports are bound; when ``kvsim.policies`` is the one being imported, it is already under way and this does
nothing.
"""

import importlib

importlib.import_module("kvsim.policies")
