"""rlserve.loader"""
