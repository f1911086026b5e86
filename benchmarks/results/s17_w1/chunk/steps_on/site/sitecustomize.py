try:
    from benchmarks.step_trace import install
    install()
except Exception as e:  # a broken probe must not stop the server
    import sys; print('benchmarks.step_trace:', e, file=sys.stderr)
