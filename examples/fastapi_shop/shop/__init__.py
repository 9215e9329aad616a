"""A small FastAPI shop: an order and its confirmation commit together, on async SQLAlchemy."""
