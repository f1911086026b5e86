"""rlserve.transfer"""
