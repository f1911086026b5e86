"""rlserve.server"""
