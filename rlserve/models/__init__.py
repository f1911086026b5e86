"""rlserve.models"""
