"""A stand-in for mamba-ssm on the CPU (tests only): ``ops.selective_scan_interface``'s
``selective_scan_fn`` with the library's signature and layouts, computed token by token in
float64 from its documented definition, each call recorded in ``CALLS``."""

__version__ = "0.0.stand-in"
CALLS: list[dict] = []
