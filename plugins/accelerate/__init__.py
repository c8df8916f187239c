"""The Hugging Face Accelerate plugin: ``MultiDCAccelerator`` and its settings, ``MultiDCPlugin``.

Needs the ``accelerate`` extra (``pip install 'multidc[accelerate]'``); importing this package without it raises an
ImportError that says so. ``accelerator`` is the ``Accelerator`` subclass; ``plugin`` its validated settings;
``parallel`` the launch / data-loader / scheduler glue of a parallel layout (``multidc.hierarchical.parallel``);
``state`` ``save_state`` / ``load_state`` through the checkpoint engine (``multidc.plugins.checkpoint``).
"""

from multidc.plugins.accelerate.accelerator import MultiDCAccelerator
from multidc.plugins.accelerate.plugin import MultiDCPlugin

__all__ = ["MultiDCAccelerator", "MultiDCPlugin"]
