from golden_testlib import one_blas_thread  # noqa: F401  (autouse: this directory's modules on one BLAS thread)
