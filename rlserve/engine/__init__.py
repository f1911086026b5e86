"""rlserve.engine"""
