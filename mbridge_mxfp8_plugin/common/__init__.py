"""Leaves every room may use: rank-zero logging, argument and YAML-type helpers, the MXFP8 cast
rule, and the message for a missing optional dependency. They import nothing else of the package.
"""
