import re

from setuptools import find_packages, setup

# one version string: solar/__init__.py's __version__
VERSION = re.search(r'^__version__ = "([^"]+)"', open("solar/__init__.py").read(), re.M).group(1)

setup(
    name="solar-hdf5",
    version=VERSION,
    description="HDF5 data loading for distributed PyTorch training with an offline, reuse-maximising schedule",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    python_requires=">=3.10",  # traceback.format_exception(exc) with one argument
    packages=find_packages(include=["solar", "solar.*"]),
    package_data={"solar": ["py.typed"]},  # PEP 561: the annotations are part of the API
    install_requires=[
        "numpy>=1.23",
        "h5py>=3.8",
        "numba>=0.57",
        "tqdm>=4.60",
        "torch>=2.1",  # admits the pinned torch==2.13.0 that the install step puts in first
    ],
    extras_require={
        # MPI is optional: torchrun / srun jobs run on the pread reader without it.  mpi4py gives the
        # mpiio and h5py-mpio readers, mpiexec jobs with a communicator and `mpiexec solar bench`
        "mpi": ["mpi4py>=3.1"],  # built against the site MPI on clusters
        "mpich": ["mpi4py>=3.1", "mpich"],  # ... or with MPICH from PyPI
        "plot": ["matplotlib>=3.5"],
        # faster gzip inflate (libdeflate), used automatically when installed; stdlib zlib otherwise
        "fast": ["deflate>=0.9"],
        # raw decoding of hdf5plugin's Blosc, LZ4, Bitshuffle and Zstd filters (else h5py reads them)
        "codecs": ["numcodecs>=0.12"],
        # the Lightning and Accelerate variants of the PtychoNN example (examples/)
        "frameworks": ["lightning>=2.0", "accelerate>=0.26"],
        "test": ["pytest>=7", "pytest-xdist>=3", "hypothesis>=6", "matplotlib>=3.5", "numcodecs>=0.12",
                 "hdf5plugin>=4.0", "deflate>=0.9",
                 "mpi4py>=3.1",  # the MPI tests; `make test` adds the mpich extra for mpiexec
                 "lightning>=2.0", "accelerate>=0.26"],  # the examples' framework variants run in the tests
    },
    entry_points={"console_scripts": ["solar=solar.cli:main"]},
)
