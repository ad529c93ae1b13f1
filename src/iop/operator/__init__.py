"""The kopf operator for the EdgeConfig custom resource (`iop operator ...`).

It lives at `src/iop/operator/`, so it is only ever imported as `iop.operator`: nothing puts
`src/iop/` on `sys.path`, and the standard library's `operator` stays the one `import operator`
finds (tests/test_layout.py pins this).
"""

__all__: list[str] = []
