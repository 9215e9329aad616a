"""Placing an order: the order and its two tasks commit together, or not at all."""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse

from .models import Order
from .tasks import charge, send_receipt


class OutOfStock(Exception):
    pass


def place_order(request: HttpRequest) -> HttpResponse:
    try:
        with transaction.atomic():
            order = Order.objects.create(
                customer=request.POST["customer"], cents=int(request.POST["cents"])
            )
            charge.delay(order.pk)
            send_receipt.delay(order.pk)
            if request.POST.get("in_stock") == "no":
                raise OutOfStock(order.pk)  # rolls back the order and both task calls
    except OutOfStock:
        return JsonResponse({"error": "out of stock"}, status=409)
    return JsonResponse({"order": order.pk}, status=201)
