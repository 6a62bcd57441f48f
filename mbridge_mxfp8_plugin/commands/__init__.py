"""The command line: ``mxfp8-plugin`` (``cli``) and what it runs: ``demo``, ``doctor``, ``check``, and
the Bridge launcher (``launch``, with its dry-run report).
"""
