"""rlserve.layers"""
