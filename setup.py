"""Builds tokenmill's native CPU kernels at install time (the metadata is pyproject.toml's).

Every capability level of the build machine's architecture (tokenmill/kernels/levels.py:
the same flags, sources and digest the run-time loader uses) is compiled with torch's C++
extension builder into tokenmill.kernels._C_<level>, with a build record _C_<level>.json
beside it: the torch it was built against and the digest of its sources and flags, which
the loader checks before it imports the module.

The kernels link against the torch of the build, so build against the torch you run:
install torch first, then build without an isolated build environment:

    pip install --no-build-isolation -e .        (what `make install` does)
    pip wheel --no-build-isolation --no-deps .

MAX_JOBS caps the compile jobs (default: every core). TOKENMILL_NO_NATIVE=1, or no C++
compiler, builds no kernels: tokenmill then compiles them at first use, or runs its
PyTorch path.
"""
import copy
import glob
import hashlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import sys
import sysconfig
import warnings

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join("tokenmill", "kernels")  # relative: setuptools wants relative sources


def _load_levels():
    """levels.py by its path: importing the tokenmill package may need what is not
    installed yet, and levels.py needs nothing but the standard library."""
    spec = importlib.util.spec_from_file_location("_tokenmill_kernel_levels",
                                                  os.path.join(ROOT, KERNELS, "levels.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


levels = _load_levels()


def _why_no_kernels():
    if os.environ.get("TOKENMILL_NO_NATIVE") == "1":
        return "TOKENMILL_NO_NATIVE=1"
    cxx = os.environ.get("CXX", "c++")
    if not shlex.split(cxx) or shutil.which(shlex.split(cxx)[0]) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH)"
    return None


CONTENTS = "sources.json"  # in a level's object folder: what its objects were built from


def _contents() -> dict:
    """sha256 of every kernel source and header, by name."""
    out = {}
    for name in levels.sources() + levels.headers():
        with open(os.path.join(levels.KERNELS_DIR, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _drop_changed_objects(build_temp: str, contents: dict) -> None:
    """ninja rebuilds what is older than its sources; a source whose bytes changed while
    its time went back (restored from an archive, cp -p) would keep its old object. So,
    by content against the last build: a changed .cpp drops its object, a changed header
    (or no record of the last build) the whole folder."""
    try:
        with open(os.path.join(build_temp, CONTENTS)) as f:
            last = json.load(f)
    except (OSError, ValueError):
        last = None
    if last == contents:
        return
    def headers(c):
        return {k: v for k, v in c.items() if k.endswith(".h")}
    if not isinstance(last, dict) or headers(last) != headers(contents):
        shutil.rmtree(build_temp, ignore_errors=True)
        return
    for name in levels.sources():
        if last.get(name) != contents[name]:
            stem = os.path.splitext(name)[0]
            for obj in glob.glob(os.path.join(build_temp, "**", stem + ".o"), recursive=True):
                os.remove(obj)


def _kernel_build():
    """The extension modules and the build_ext command that builds them."""
    try:
        # numpy, a run-time dependency, is not installed yet when pip builds this
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as e:
        sys.exit(f"tokenmill builds its native kernels against the installed torch, and "
                 f"found none ({e}). Install torch first (pip install torch==2.13.0), then "
                 f"tokenmill with --no-build-isolation; or set TOKENMILL_NO_NATIVE=1 to "
                 f"install without the kernels.")

    sources = [os.path.join(KERNELS, f) for f in levels.sources()]
    headers = [os.path.join(KERNELS, f) for f in levels.headers()]
    buildable = {name: level for name, level in levels.LEVELS.items()
                 if levels.compiler_accepts(level)}
    for name in levels.LEVELS.keys() - buildable.keys():
        print(f"tokenmill: the C++ compiler does not take the {name} level's flags "
              f"({' '.join(levels.LEVELS[name].flags)}): that level is not built; the "
              f"ones below it serve", file=sys.stderr)
    extensions = [CppExtension(f"tokenmill.kernels.{levels.module_name(name)}", sources,
                               extra_compile_args=levels.compile_flags(level), depends=headers)
                  for name, level in buildable.items()]

    def level_of(ext) -> str:
        return ext.name.rsplit(".", 1)[1][len(levels.PREBUILT_PREFIX):]

    def record_beside(module_path: str, level: str) -> str:
        return levels.record_path(os.path.dirname(module_path), level)

    class BuildKernels(BuildExtension):
        """torch's builder, and: the levels compile side by side, each in its own object
        folder (they share their sources); with only the flags the run-time build uses;
        each module with its build record."""

        def finalize_options(self):
            super().finalize_options()
            if self.parallel is None:  # the levels at once, the cores split between them
                jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
                self.parallel = max(1, min(len(self.extensions), jobs))
                self._jobs_per_level = math.ceil(jobs / self.parallel)
            else:
                self._jobs_per_level = None

        def build_extensions(self):
            # The same code as the run-time build: torch's flags and ours, without the
            # ones Python itself was compiled with (-g, -fwrapv, -DNDEBUG, -Wall, ...).
            python_flags = set(shlex.split(sysconfig.get_config_var("CFLAGS") or ""))
            cc = self.compiler.compiler_so
            kept = cc[:1] + [f for f in cc[1:] if f not in python_flags]
            self.compiler.set_executables(compiler_so=kept + ([] if "-fPIC" in kept else ["-fPIC"]))
            saved = os.environ.get("MAX_JOBS")
            if self._jobs_per_level is not None:  # read by each level's ninja run
                os.environ["MAX_JOBS"] = str(self._jobs_per_level)
            try:
                super().build_extensions()
            finally:
                if saved is None:
                    os.environ.pop("MAX_JOBS", None)
                else:
                    os.environ["MAX_JOBS"] = saved

        def build_extension(self, ext):
            level = level_of(ext)
            # The record describes the sources as they are before the compile: an edit
            # made during it leaves a record that does not match them (so is not trusted).
            record = levels.make_record(levels.LEVELS[level], torch.__version__,
                                        getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None),
                                        sys.implementation.cache_tag)
            contents = _contents()
            # This level's objects and ninja file, apart from the other levels' (the same
            # sources), and in the project rather than the build's temporary folder (an
            # editable install gets a fresh one each time): reinstalling after an edit
            # recompiles only what the edit touched.
            own = copy.copy(self)
            own.build_temp = os.path.join(ROOT, "build", "kernels", level)
            _drop_changed_objects(own.build_temp, contents)
            super(BuildKernels, own).build_extension(ext)
            with open(os.path.join(own.build_temp, CONTENTS), "w") as f:
                json.dump(contents, f, indent=1)
            levels.write_record(record_beside(self.get_ext_fullpath(ext.name), level), record)

        def copy_extensions_to_source(self):  # editable installs: the records go along
            super().copy_extensions_to_source()
            package_dir = self.get_finalized_command("build_py").get_package_dir("tokenmill.kernels")
            for ext in self.extensions:
                level = level_of(ext)
                built = os.path.join(self.build_lib, self.get_ext_filename(ext.name))
                self.copy_file(record_beside(built, level), levels.record_path(package_dir, level))

        def get_outputs(self):
            outputs = super().get_outputs()
            if not self.inplace:
                outputs += [record_beside(self.get_ext_fullpath(ext.name), level_of(ext))
                            for ext in self.extensions]
            return outputs

    return extensions, BuildKernels


why_not = _why_no_kernels()
if why_not:
    print(f"tokenmill: not building the native CPU kernels ({why_not}); they compile at first "
          f"use instead, or the PyTorch path runs", file=sys.stderr)
    setup()
else:
    ext_modules, build_ext = _kernel_build()
    setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
