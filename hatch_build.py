"""The wheel's layout: each root folder's modules go to ``moezoo/<name>/``, beside the
``__init__.py`` that the thin package ``moezoo/`` holds for it (``moezoo/__init__.py`` says why a
checkout splits them).

Only the standard wheel is assembled so: an editable install maps the name ``moezoo`` to
``./moezoo`` alone, whose ``__init__.py`` files add the root folders to their ``__path__``, so
nothing is copied and the checkout's root never goes on ``sys.path``.
"""

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SUBPACKAGES = ("layers", "kernels", "zoo", "configs", "training")


class WheelLayoutHook(BuildHookInterface):
    def initialize(self, version, build_data):
        if self.target_name == "wheel" and version == "standard":
            build_data["force_include"].update({name: f"moezoo/{name}" for name in SUBPACKAGES})
