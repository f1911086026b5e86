try:
    from benchmarks.step_trace import install
    install()
except Exception as e:  # a broken probe must not stop the server
    import sys; print('benchmarks.step_trace:', e, file=sys.stderr)
try:
    from benchmarks.stream_trace import install
    install()
except Exception as e:  # a broken probe must not stop the server
    import sys; print('benchmarks.stream_trace:', e, file=sys.stderr)
try:
    from benchmarks.api_stream_probe import install
    install()
except Exception as e:  # a broken probe must not stop the server
    import sys; print('benchmarks.api_stream_probe:', e, file=sys.stderr)
